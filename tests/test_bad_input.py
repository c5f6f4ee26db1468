"""Every class of bad input, on every subcommand, is refused the same way (issue 15, "Must hold").

Each case asserts: exit code 2, exactly one ``opsched: error:`` line on
stderr, no traceback, nothing written (the test directory is the same file
for file and byte for byte afterwards, so pre-existing files are untouched),
and no search: every refusal comes before the long work, so the whole file
runs in seconds.

A case is ``(argv, words)``: ``argv`` is a list of strings where
``{tmp}``, ``{model}``, ``{plan}``, ``{bad_plan}``, ``{file}`` and
``{readonly}`` are filled in from the :func:`place` fixture, and ``words``
must appear in the error line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SLOW_LINK_CLUSTER, make_moe_model
from opsched.cli import main
from opsched.export.torch_csv import torch_available

# --------------------------------------------------------------------------- the places a case refers to


def _readonly_dir(tmp_path: Path) -> Path:
    """A directory nothing can be created in: mode 0555, or for root (who ignores modes) sysfs, which is read-only."""
    if os.geteuid() == 0:
        return Path("/sys")
    ro = tmp_path / "readonly"
    ro.mkdir()
    ro.chmod(0o555)
    return ro


def _plans(tmp_path: Path) -> tuple[Path, Path]:
    """A valid plan.json and one whose first two events on a device overlap (gantt and export refuse it)."""
    from opsched.baselines import run_baseline
    from opsched.export.plan_json import write_plan
    from opsched.schedule import chain_stage_graph

    good = tmp_path / "plan.json"
    doc = write_plan(good, run_baseline("1f1b", chain_stage_graph(2), 4))
    events = doc["schedule"]["events"]
    first = next(e for e in events if e["stage"] == 0 and e["microbatch"] == 1 and e["pass"] == "F")
    first["start"] -= 0.5
    first["end"] -= 0.5
    bad = tmp_path / "overlap.json"
    bad.write_text(json.dumps(doc))
    return good, bad


@pytest.fixture
def place(tmp_path):
    """The files the cases use, made before the snapshot that must not change."""
    model = tmp_path / "tiny.onnx"
    model.write_bytes(make_moe_model("legacy", layers=1, experts=2, top_k=1, default_dims="batch=1,seq=4")
                      .SerializeToString())
    plan, bad_plan = _plans(tmp_path)
    a_file = tmp_path / "afile"
    a_file.write_text("a file, not a directory\n")
    (tmp_path / "adir.svg").mkdir()
    (tmp_path / "adir.csv").mkdir()
    (tmp_path / "notonnx.onnx").write_text("not a model\n")
    (tmp_path / "notjson.json").write_text("{not json\n")
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 32}\n')
    (tmp_path / "huge.json").write_text(json.dumps(dict(SLOW_LINK_CLUSTER, devices=1_000_000)))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "plan.json").write_bytes(plan.read_bytes())  # another plan, which gantt must not replace
    return {"tmp": tmp_path, "model": model, "plan": plan, "bad_plan": bad_plan, "file": a_file,
            "readonly": _readonly_dir(tmp_path)}


# --------------------------------------------------------------------------- the cases

PLAN = ["plan", "{model}", "--time-limit", "1"]
COMPARE = ["compare", "--stages", "4", "--microbatches", "8"]
OUT = ["-o", "{tmp}/out"]

CASES = {
    # plan: counts, bounds, units
    "plan devices too many": (PLAN + ["--devices", "1000000"] + OUT, "--devices: must be at most 65,536"),
    "plan devices zero": (PLAN + ["--devices", "0"] + OUT, "--devices: must be at least 1"),
    "plan devices not a number": (PLAN + ["--devices", "eight"] + OUT, "expected a whole number"),
    "plan devices not whole nodes": (PLAN + ["--devices", "12"] + OUT, "do not fill whole nodes"),
    "plan microbatches too many": (PLAN + ["--devices", "8", "--microbatches", "100000"] + OUT,
                                   "--microbatches: must be at most 4,096"),
    "plan microbatches negative": (PLAN + ["--devices", "8", "--microbatches", "-3"] + OUT, "at least 1"),
    "plan memory without unit": (PLAN + ["--devices", "8", "--memory-limit", "80"] + OUT, "did you mean 80GiB?"),
    "plan memory unreadable": (PLAN + ["--devices", "8", "--memory-limit", "lots"] + OUT, "memory size"),
    "plan memory negative": (PLAN + ["--devices", "8", "--memory-limit", "-80GiB"] + OUT,
                             "--memory-limit: a memory size cannot be negative, got -80GiB"),
    "plan time limit zero": (PLAN + ["--devices", "8", "--time-limit", "0"] + OUT, "--time-limit"),
    "plan jobs zero": (PLAN + ["--devices", "8", "--jobs", "0"] + OUT, "--jobs"),
    "plan jobs not a number": (PLAN + ["--devices", "8", "--jobs", "all"] + OUT, "--jobs"),
    "plan capacity factor negative": (PLAN + ["--devices", "8", "--capacity-factor", "-1"] + OUT,
                                      "--capacity-factor"),
    "plan unknown preset": (PLAN + ["--devices", "8", "--preset", "tpu-v9"] + OUT, "unknown preset"),
    "plan preset and cluster": (PLAN + ["--preset", "h200", "--cluster", "{tmp}/huge.json"] + OUT, "not allowed"),
    "plan cluster file missing": (PLAN + ["--cluster", "{tmp}/nope.json"] + OUT, "nope.json"),
    "plan cluster with a million devices": (PLAN + ["--cluster", "{tmp}/huge.json"] + OUT, "at most 65,536"),
    "plan unknown solver": (PLAN + ["--devices", "8", "--solver", "gurobi"] + OUT, "invalid choice"),
    "plan unknown runtime": (PLAN + ["--devices", "8", "--runtime", "tpu"] + OUT, "invalid choice: 'tpu'"),
    "plan tp overlap for torch": (PLAN + ["--devices", "8", "--runtime", "torch", "--tp-comm-overlap", "on"] + OUT,
                                  "torch does not overlap tensor-parallel collectives"),
    "plan tp overlap for torchtitan": (PLAN + ["--devices", "8", "--runtime", "torchtitan", "--tp-comm-overlap", "on"]
                                       + OUT, "plan with --tp-comm-overlap off"),
    "plan fp8 on a device without it": (PLAN + ["--devices", "8", "--preset", "a100-80g", "--dtype", "fp8"] + OUT,
                                        "no peak FLOP/s for dtype 'fp8'"),
    "plan no devices": (PLAN + OUT, "--devices N"),
    "plan no output": (PLAN + ["--devices", "8"], "required"),
    "plan unknown flag": (PLAN + ["--devices", "8", "--frobnicate"] + OUT, "unrecognized arguments"),
    # plan: the model and its dims
    "plan model missing": (["plan", "{tmp}/nope.onnx", "--devices", "8"] + OUT, "not found"),
    "plan model is a directory": (["plan", "{tmp}/adir.svg", "--devices", "8"] + OUT, "is a directory"),
    "plan model not onnx": (["plan", "{tmp}/notonnx.onnx", "--devices", "8"] + OUT, "not"),
    "plan dim unknown name": (PLAN + ["--devices", "8", "--dim", "seqlen=8192"] + OUT,
                              "no symbolic dimension 'seqlen' (did you mean seq?); its dimensions are batch, seq"),
    "plan dim without value": (PLAN + ["--devices", "8", "--dim", "seq"] + OUT, "NAME=VALUE"),
    "plan dim zero": (PLAN + ["--devices", "8", "--dim", "seq=0"] + OUT, "--dim"),
    # plan: where the files go
    "plan out read-only": (PLAN + ["--devices", "8", "-o", "{readonly}/opsched-out"], "cannot write there"),
    "plan out under a file": (PLAN + ["--devices", "8", "-o", "{file}/out"], "is a file, not a directory"),
    "plan out is a file": (PLAN + ["--devices", "8", "-o", "{file}"], "is a file; give a directory"),
    # compare
    "compare stages too many": (["compare", "--stages", "100000", "--microbatches", "8"] + OUT,
                                "--stages: must be at most 1,024"),
    "compare microbatches too many": (["compare", "--stages", "4", "--microbatches", "100000"] + OUT,
                                      "--microbatches: must be at most 4,096"),
    "compare devices too many": (COMPARE + ["--devices", "1000000"] + OUT, "--devices: must be at most 65,536"),
    "compare stages not a number": (["compare", "--stages", "x", "--microbatches", "8"] + OUT,
                                    "expected a whole number"),
    "compare unknown method": (COMPARE + ["--methods", "nope"] + OUT, "unknown method nope"),
    "compare memory unreadable": (COMPARE + ["--memory-limit", "lots"] + OUT, "--memory-limit"),
    "compare time limit zero": (COMPARE + ["--methods", "mip", "--time-limit", "0"] + OUT, "--time-limit"),
    "compare plan missing": (["compare", "--plan", "{tmp}/nope.json"] + OUT, "no such plan file"),
    "compare out read-only": (COMPARE + ["-o", "{readonly}/opsched-out"], "cannot write there"),
    "compare out under a file": (COMPARE + ["-o", "{file}/out"], "is a file, not a directory"),
    "compare out is a file": (COMPARE + ["-o", "{file}"], "is a file; give a directory"),
    "compare no work": (COMPARE + ["--f", "0", "--b", "0", "--w", "0"] + OUT, "no work to schedule"),
    "compare v that does not fit": (["compare", "--stages", "8", "--devices", "3", "--placement", "v",
                                     "--microbatches", "8"] + OUT, "--placement v: 8 stages fit on 3 devices"),
    "compare memory negative": (COMPARE + ["--memory-limit", "-5GiB"] + OUT, "cannot be negative"),
    "compare methods empty": (COMPARE + ["--methods", ""] + OUT, "--methods '' names no method"),
    "compare every method refused": (COMPARE + ["--methods", "gpipe,1f1b,dualpipe", "--memory-limit", "0.5"] + OUT,
                                     "every method was refused"),
    # gantt
    "gantt onto its own input": (["gantt", "{plan}", "-o", "{plan}"], "is the input"),
    "gantt onto its input by another name": (["gantt", "{plan}", "-o", "{tmp}/./plan.json"], "is the input"),
    "gantt out read-only": (["gantt", "{plan}", "-o", "{readonly}/g.svg"], "cannot write there"),
    "gantt out under a file": (["gantt", "{plan}", "-o", "{file}/g.svg"], "is a file, not a directory"),
    "gantt out is a directory": (["gantt", "{plan}", "-o", "{tmp}/adir.svg"], "is a directory"),
    "gantt over another plan": (["gantt", "{plan}", "-o", "{tmp}/other/plan.json"], "is a plan file"),
    "gantt unknown suffix": (["gantt", "{plan}", "-o", "{tmp}/g.unknown"], "cannot tell the Gantt format"),
    "gantt overlapping events": (["gantt", "{bad_plan}", "-o", "{tmp}/g.svg"], "is not a valid plan"),
    "gantt plan missing": (["gantt", "{tmp}/nope.json", "-o", "{tmp}/g.svg"], "nope.json"),
    "gantt plan not json": (["gantt", "{tmp}/notjson.json", "-o", "{tmp}/g.svg"], "notjson.json"),
    # export
    "export csv read-only": (["export", "{plan}", "--torch-csv", "{readonly}/s.csv"], "cannot write there"),
    "export csv under a file": (["export", "{plan}", "--torch-csv", "{file}/s.csv"], "is a file, not a directory"),
    "export csv is a directory": (["export", "{plan}", "--torch-csv", "{tmp}/adir.csv"], "is a directory"),
    "export csv onto its input": (["export", "{plan}", "--torch-csv", "{plan}"], "is the input"),
    "export overlapping events": (["export", "{bad_plan}", "--torch-csv", "{tmp}/s.csv"], "is not a valid plan"),
    "export plan missing": (["export", "{tmp}/nope.json", "--torch-csv", "{tmp}/s.csv"], "nope.json"),
    "export no csv": (["export", "{plan}"], "required"),
    # inspect
    "inspect model missing": (["inspect", "{tmp}/nope.onnx"], "not found"),
    "inspect model not onnx": (["inspect", "{tmp}/notonnx.onnx"], "not"),
    "inspect dim without value": (["inspect", "{model}", "--dim", "seq"], "NAME=VALUE"),
    "inspect dim unknown name": (["inspect", "{model}", "--dim", "seqlen=8192"],
                                 "--dim seqlen: the model has no symbolic dimension 'seqlen' (did you mean seq?)"),
    "inspect blocks zero": (["inspect", "{model}", "--blocks", "0"], "--blocks: must be at least 1"),
    "inspect capacity factor zero": (["inspect", "{model}", "--capacity-factor", "0"], "--capacity-factor"),
    # run (torch or not: each refusal comes before torch is needed, or is the missing torch itself)
    "run odd width": (["run", "{plan}", "--dim", "15"], "--dim: must be an even number"),
    "run steps zero": (["run", "{plan}", "--steps", "0"], "--steps: must be at least 1"),
    "run timeout negative": (["run", "{plan}", "--timeout", "-1"], "--timeout"),
    # onnx --hf-config: each refusal comes before transformers is imported
    "onnx config missing": (["onnx", "--hf-config", "{tmp}/nope.json", "-o", "{tmp}/m.onnx"], "file not found"),
    "onnx config not json": (["onnx", "--hf-config", "{tmp}/notjson.json", "-o", "{tmp}/m.onnx"], "not valid JSON"),
    "onnx config without model_type": (["onnx", "--hf-config", "{tmp}/huge.json", "-o", "{tmp}/m.onnx"],
                                       'no "model_type" key'),
    "onnx config is a directory": (["onnx", "--hf-config", "{tmp}/adir.svg", "-o", "{tmp}/m.onnx"], "is a directory"),
    "onnx out directory missing": (["onnx", "--hf-config", "{tmp}/config.json", "-o", "{tmp}/no/m.onnx"],
                                   "does not exist"),
    "onnx out under a file": (["onnx", "--hf-config", "{tmp}/config.json", "-o", "{file}/m.onnx"],
                              "is a file, not a directory"),
    "onnx out is a directory": (["onnx", "--hf-config", "{tmp}/config.json", "-o", "{tmp}/adir.svg"], "is a directory"),
    "onnx out read-only": (["onnx", "--hf-config", "{tmp}/config.json", "-o", "{readonly}/m.onnx"],
                           "cannot write there"),
    "onnx no output": (["onnx", "--hf-config", "{tmp}/config.json"], "required"),
    "onnx seq-len zero": (["onnx", "--hf-config", "{tmp}/config.json", "-o", "{tmp}/m.onnx", "--seq-len", "0"],
                          "--seq-len: must be at least 1"),
    "onnx unknown dtype": (["onnx", "--hf-config", "{tmp}/config.json", "-o", "{tmp}/m.onnx", "--dtype", "int4"],
                           "invalid choice"),
    # the command itself
    "unknown command": (["frobnicate"], "invalid choice"),
    "no command": ([], "give a command"),
}

HAS_TORCH = torch_available()
NO_TORCH = 'needs torch: pip install "opsched[torch]"'
CASES.update({
    "run plan missing": (["run", "{tmp}/nope.json"], "nope.json" if HAS_TORCH else NO_TORCH),
    "run csv read-only": (["run", "{plan}", "--torch-csv", "{readonly}/s.csv"],
                          "cannot write there" if HAS_TORCH else NO_TORCH),
    "run csv onto its input": (["run", "{plan}", "--torch-csv", "{plan}"], "is the input" if HAS_TORCH else NO_TORCH),
    "run overlapping events": (["run", "{bad_plan}"], "is not a valid plan" if HAS_TORCH else NO_TORCH),
})


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` with its kind, bytes and modification time."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = ("dir", st.st_mtime_ns) if p.is_dir() else ("file", p.read_bytes(), st.st_mtime_ns)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, place, capsys):
    argv_template, words = CASES[case]
    argv = [a.format(**place) for a in argv_template]
    before = _snapshot(place["tmp"])
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2, (case, captured.err)
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("opsched: error: "), lines[0]
    assert words in lines[0], (words, lines[0])
    assert "Traceback" not in captured.err + captured.out
    assert _snapshot(place["tmp"]) == before, "the command wrote or changed a file"
    assert not (place["readonly"] / "opsched-out").exists()
    if case != "compare every method refused":  # that one prints its table, each row saying why
        assert captured.out == ""


def test_there_are_at_least_40_cases():
    assert len(CASES) >= 40


DIM_CASES = [case for case in CASES if " dim " in case]


@pytest.mark.parametrize("case", DIM_CASES)
def test_a_dim_error_names_the_flag_once(case, place, capsys):
    argv_template, _words = CASES[case]
    assert main([a.format(**place) for a in argv_template]) == 2
    assert capsys.readouterr().err.count("--dim") == 1


def test_a_missing_highs_is_one_line_with_one_hint(place):
    """python-mip's own two lines (logging's last resort) and its second install hint stay out of the output."""
    env = dict(os.environ, PMIP_HIGHS_LIBRARY=str(place["tmp"] / "no-libhighs.so"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    before = _snapshot(place["tmp"])
    done = subprocess.run([sys.executable, "-m", "opsched", *COMPARE, "--methods", "mip", "--solver", "highs",
                           "-o", str(place["tmp"] / "out")], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("opsched: error: solver highs is not available"), done.stderr
    assert lines[0].count("pip install") == 1 and 'pip install "opsched[highs]"' in lines[0]
    assert _snapshot(place["tmp"]) == before


def test_inspect_says_import_warnings_on_stderr_too(tmp_path, capsys):
    """An op the import cannot cost is in the summary (stdout) and on stderr, where a --json reader still sees it."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("FancyOp", ["r"], ["y"], name="fancy", domain="com.example")]
    graph = helper.make_graph(nodes, "u", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.example", 1)])
    path = tmp_path / "u.onnx"
    path.write_bytes(model.SerializeToString())
    assert main(["inspect", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert "FancyOp" in json.loads(captured.out)["warnings"][0]
    warned = [line for line in captured.err.splitlines() if line.startswith("import: warning:")]
    assert len(warned) == 1 and "FancyOp" in warned[0]
