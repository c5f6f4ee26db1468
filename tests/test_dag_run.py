"""`opsched run` on plans whose stage graph is a DAG: opsched's own point-to-point executor
(opsched/torchrun/dag_runtime.py) on gloo ranks, gradients against one process.

The fast tests run a hand-made diamond (a fork and a join, a split backward on one rank, two stages on
one rank) and check the refusals; the slow ones take a tiny CLIP and a tiny MMT through their ONNX,
`opsched plan` (a plan whose stages branch) and `opsched run`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from opsched.cli import main
from opsched.export.plan_json import write_plan
from opsched.schedule import Edge, Job, Schedule, Stage, StageGraph, simulate, validate

#: a fork (stage 0 feeds 1 and 2) and a join (1 and 2 feed 3); stage 3 shares device 0 with stage 0
DIAMOND = ((0, 1), (0, 2), (1, 3), (2, 3))


def diamond_schedule(microbatches: int = 3) -> Schedule:
    stages = [Stage(i, (d,), {"F": 1.0, "I": 1.0, "W": 1.0}) for i, d in enumerate((0, 1, 2, 0))]
    sg = StageGraph(stages, [Edge(a, b) for a, b in DIAMOND], num_devices=3)
    ms = range(microbatches)
    order = {
        0: [Job(0, m, "F") for m in ms] + [Job(3, m, p) for m in ms for p in ("F", "B")]
           + [Job(0, m, "B") for m in ms],
        1: [Job(1, m, "F") for m in ms] + [Job(1, m, "B") for m in reversed(ms)],
        2: [Job(2, m, "F") for m in ms] + [Job(2, m, p) for m in ms for p in ("I", "W")],  # split backward
    }
    schedule = Schedule(sg, microbatches, simulate(sg, order, microbatches))
    validate(schedule)
    return schedule


def test_executor_runs_a_diamond_with_one_process_gradients():
    """Fork, join, I/W and two stages on one rank: losses and every gradient equal one process to 1e-12."""
    from opsched.export.torch_csv import stage_ranks
    from opsched.torchrun.dag_models import GraphMlpSpec
    from opsched.torchrun.dag_runtime import DagJob, dag_rows, run_dag_job
    from opsched.torchrun.launch import compare_with_reference

    schedule = diamond_schedule()
    spec = GraphMlpSpec(DIAMOND, 4, dim=8)
    job = DagJob(spec, stage_ranks(schedule.stage_graph), dag_rows(schedule), DIAMOND, schedule.microbatches,
                 microbatch_size=2, steps=2)
    assert job.world_size == 3 and job.rows[2][3:5] == ((2, 0, "I"), (2, 0, "W"))
    results = run_dag_job(job, timeout=120)
    report = compare_with_reference(job, results, rtol=1e-12, atol=1e-14)
    assert report["ok"], report["problems"][:3]
    assert report["params"] == 8 and report["max_rel_grad_diff"] < 1e-12
    assert len(results[0].losses) == 2 and len(results[0].losses[0]) == 3  # the sink's rank: per step, microbatch


def test_fork_gradient_is_the_sum_of_its_consumers():
    """What the check would see if a fork kept one consumer's gradient only: stage 0's gradient differs."""
    from opsched.torchrun.dag_models import GraphMlpSpec
    from opsched.torchrun.dag_runtime import DagJob
    from opsched.torchrun.launch import RankResult, compare_with_reference

    spec = GraphMlpSpec(DIAMOND, 4, dim=8)
    job = DagJob(spec, {0: 0, 1: 1, 2: 2, 3: 0}, ((),) * 3, DIAMOND, 2, steps=1)
    x, y = spec.batch(4, 0)
    losses, grads = spec.reference_step(spec.build_stage_modules(), x, y, 2)
    one_branch = GraphMlpSpec(((0, 1), (1, 3), (2, 3)), 4, dim=8)  # stage 2 reads the data, not stage 0's output
    _, partial = one_branch.reference_step(one_branch.build_stage_modules(), x, y, 2)
    assert compare_with_reference(job, [RankResult(0, [0, 1, 2, 3], losses=[losses], grads=[grads])])["ok"]
    bad = compare_with_reference(job, [RankResult(0, [0, 1, 2, 3], losses=[losses], grads=[{**grads, **{
        k: v for k, v in partial.items() if k.startswith("0.")}}])])
    assert not bad["ok"] and any("0.linear" in p for p in bad["problems"])


def test_dag_plan_runs_with_the_stand_in(tmp_path, capsys):
    """`opsched run PLAN` without a model config: a branching plan runs the MLP stand-in wired as its graph."""
    plan = tmp_path / "plan.json"
    write_plan(plan, diamond_schedule(2))
    assert main(["run", str(plan), "--steps", "1"]) == 0
    text = capsys.readouterr().out
    assert "opsched's point-to-point executor" in text and "8 parameter gradients match" in text, text


def test_report_says_who_runs_a_branching_plan():
    """report.md's Runtimes section: the production runtimes take a chain; `opsched run` runs a DAG."""
    from opsched.plan.report import runtimes_table

    why = {"torch": "the StageGraph branches", "megatron": "branches", "torchtitan": "branches"}
    text = "\n".join(runtimes_table(why, branches=True))
    assert "Megatron-LM and torchtitan cannot run it" in text and "a chain of stages (a V at most)" in text
    assert "`opsched run plan.json` runs it" in text and "not a production runtime" in text
    assert "opsched run" not in "\n".join(runtimes_table(why))


def test_dag_plan_with_two_sinks_or_a_torch_csv_is_refused(tmp_path, capsys):
    stages = [Stage(i, (i,), {"F": 1.0, "I": 1.0, "W": 1.0}) for i in range(3)]
    sg = StageGraph(stages, [Edge(0, 1), Edge(0, 2)], num_devices=3)
    order = {s: [Job(s, m, p) for p in ("F", "B") for m in range(2)] for s in range(3)}
    schedule = Schedule(sg, 2, simulate(sg, order, 2))
    plan = tmp_path / "plan.json"
    write_plan(plan, schedule)
    assert main(["run", str(plan)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "stages [1, 2] feed no other stage" in err, err
    write_plan(plan, diamond_schedule(2))  # a DAG runs on opsched's executor: there is no torch CSV to keep
    assert main(["run", str(plan), "--torch-csv", str(tmp_path / "keep.csv")]) == 2
    assert "no torch CSV" in capsys.readouterr().err


def test_export_of_towers_joined_late_says_the_plan_branches():
    """Towers 0 -> 3, 1 -> 4 and 2 joined at 5 (a planned MMT): stage 0 forks nothing, yet no renumbering makes
    the graph a chain, so the refusal names the join, not the numbering."""
    from opsched.errors import OpschedError
    from opsched.export.torch_csv import check_expressible

    stages = [Stage(i, (i % 3,), {"F": 1.0, "I": 1.0, "W": 1.0}) for i in range(6)]
    sg = StageGraph(stages, [Edge(a, b) for a, b in ((0, 3), (1, 4), (2, 5), (3, 5), (4, 5))], num_devices=3)
    with pytest.raises(OpschedError, match=r"branches \(stages \[2, 3, 4\] feed stage 5\)") as exc:
        check_expressible(sg, 2)
    assert "number the stages" not in str(exc.value)


# --------------------------------------------------------------------------- the user's path (slow)

CLIP = dict(model_type="clip", projection_dim=16,
            text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=16, eos_token_id=63, bos_token_id=62,
                             pad_token_id=1),
            vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                               image_size=32, patch_size=8))
MMT = dict(model_type="mmt", branches=3, layers=2, dim=16, heads=2, ff=32, seq=8)


def test_torch_mmt_is_the_onnx_mmt():
    """The runnable MMT has the parameters of models/build.py's, module path by module path."""
    from opsched.torchrun.mmt import MmtSpec
    from tests.test_models import load_build, metadata, weights

    build = load_build()
    sizes = {k: MMT[k] for k in ("layers", "dim", "heads", "ff", "seq")}
    model = build.branchy_transformer("mmt_tiny", MMT["branches"], "tiny", sizes)
    onnx_params = weights(model)
    spec = MmtSpec(**{k: MMT[k] for k in ("branches", *sizes)}, entries=(), exits=(), ranges=((),), routes=())
    torch_params = dict(spec.build_full_model().named_parameters())
    assert sum(p.numel() for p in torch_params.values()) == int(metadata(model)["opsched.param_count"]) == 14224
    # the same names; a linear's weight is [in, out] in the ONNX, [out, in] in torch
    assert {n: list(p.shape)[::-1] for n, p in torch_params.items()} == onnx_params


def branches_of(doc: dict) -> bool:
    """Whether a plan's stage graph is not a chain."""
    succs: dict[int, int] = {}
    for e in doc["edges"]:
        succs[e["src"]] = succs.get(e["src"], 0) + 1
    return any(n > 1 for n in succs.values()) or any(len(s["preds"]) > 1 for s in doc["stages"])


def plan_and_run(tmp_path: Path, capsys, onnx_path: Path, flag: str, config: Path, devices: int) -> str:
    out = tmp_path / f"plan{devices}"
    assert main(["plan", str(onnx_path), "--devices", str(devices), "--microbatches", "4", "--time-limit", "20",
                 "-o", str(out), "-q"]) == 0
    doc = json.loads((out / "plan.json").read_text())
    assert branches_of(doc), [(e["src"], e["dst"]) for e in doc["edges"]]
    report = (out / "report.md").read_text()
    assert "torchtitan cannot run it" in report and "`opsched run plan.json` runs it" in report
    capsys.readouterr()
    assert main(["run", str(out / "plan.json"), flag, str(config), "--steps", "2"]) == 0
    text = capsys.readouterr().out
    assert "opsched's point-to-point executor" in text, text
    rel = float(re.search(r"max relative grad diff ([0-9.e+-]+)", text).group(1))
    assert rel < 1e-12, text
    return text


@pytest.mark.slow
def test_clip_dag_plan_runs(tmp_path, capsys):
    """CLIP's towers on their own stages, joined by the loss stage: every gradient as CLIPModel's on one process."""
    pytest.importorskip("transformers")
    config = tmp_path / "clip.json"
    config.write_text(json.dumps(CLIP))
    onnx_path = tmp_path / "clip.onnx"
    assert main(["onnx", "--hf-config", str(config), "-o", str(onnx_path), "--seq-len", "16"]) == 0
    for devices in (3, 4):
        text = plan_and_run(tmp_path, capsys, onnx_path, "--hf-config", config, devices)
        assert "vision embedded on stage 0" in text and "parameter gradients match" in text, text


@pytest.mark.slow
def test_mmt_dag_plan_runs(tmp_path, capsys):
    """A tiny MMT (3 branches x 2 layers, width 16): each branch on its own devices, joined by the fusion."""
    from tests.test_models import load_build

    build = load_build()
    sizes = {k: MMT[k] for k in ("layers", "dim", "heads", "ff", "seq")}
    onnx_path = tmp_path / "mmt.onnx"
    build.write_model(build.branchy_transformer("mmt_tiny", MMT["branches"], "tiny", sizes), str(onnx_path))
    config = tmp_path / "mmt.json"
    config.write_text(json.dumps(MMT))
    text = plan_and_run(tmp_path, capsys, onnx_path, "--mmt-config", config, 3)
    # 3 branches x (2 layers x 16 (2 norms, q, k, v, out, fc1, fc2: weight and bias each) + the final norm's 2)
    # + the fusion's weight and bias
    assert "104 parameter gradients match" in text, text
