"""`opsched plan --runtime R` (issue 14 item 6): only plans R can run, and every plan says which runtimes can run it.

"Can R run it" has one home, :func:`opsched.export.runtimes.refusal`, which
runs the export's own checks: the property test below holds it to what
`opsched export` does on the same plans. The end-to-end runs plan a bundled
model for each runtime and export the result, read back by the frameworks'
own configuration classes where they are installed (skipped cleanly where not).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from opsched.cli import main
from opsched.export.plan_json import read_plan
from opsched.export.runtimes import RUNTIMES, refusal, verdicts
from test_export_frameworks import (  # noqa: F401  (torchtitan_config is a fixture)
    LLAMA,
    REFUSALS,
    _snapshot,
    chain_modules,
    export,
    make_plan,
    megatron_argv,
    megatron_config,
    torchtitan_config,
)
from test_plan_json import schema_errors

MODELS = Path(__file__).resolve().parent.parent / "models"

#: the export flags of each runtime, as `opsched export` takes them (the files go into the test's directory)
def export_argv(runtime: str, directory: Path) -> list[str]:
    """`opsched export`'s options that write ``runtime``'s files into ``directory``, read from its
    ``Runtime.export_flags`` (``--torchtitan F.toml --torch-csv F.csv``: each F a file there)."""
    return [w if w.startswith("--") else str(directory / w) for w in RUNTIMES[runtime].export_flags.split()]


def exports(tmp_path: Path, plan: Path, runtime: str) -> tuple[bool, str]:
    """(whether `opsched export PLAN` writes ``runtime``'s files, its stderr), in a fresh directory."""
    out = tmp_path / f"out-{runtime}-{len(list(tmp_path.iterdir()))}"
    code, _stdout, err = export(tmp_path, plan, *export_argv(runtime, out), "--no-torch-check")
    assert code in (0, 2), err
    return code == 0, err


def test_the_runtimes_are_the_exports_and_plan_help_names_them(capsys):
    """Every runtime of the registry is a choice of `plan --runtime`, and the options that write its files are
    `opsched export`'s (a runtime added by the recipe of docs/architecture.md passes with no test edited)."""
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"--runtime {{any,{','.join(RUNTIMES)}}}" in text and "keep only plans this runtime can run" in text
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    export_help = capsys.readouterr().out
    for runtime in RUNTIMES:
        flags = [w for w in export_argv(runtime, Path("d")) if w.startswith("--")]
        assert flags and all(f in export_help for f in flags), runtime


# --------------------------------------------------------------------------- one home: refusal == the export


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusal_agrees_with_the_export_on_every_refused_shape(tmp_path, case):
    """Every plan shape the export refuses for some framework: refusal() says the same, word for word."""
    make, _reasons = REFUSALS[case]
    plan = make(tmp_path)
    schedule, doc = read_plan(plan)
    for runtime in RUNTIMES:
        ok, err = exports(tmp_path, plan, runtime)
        why = refusal(runtime, schedule, doc)
        assert (why is None) == ok, (runtime, why, err)
        if why is not None:
            assert err.strip() == f"opsched: error: {why}", (runtime, err)


def test_a_layer_split_between_stages_is_refused_for_torch_as_by_its_export(tmp_path):
    """Issue 45: torch's runtime builds stages from whole layers (`opsched run --hf-config`), so a plan that cuts a
    layer between two stages says it cannot run on torch, and `opsched export --torch-csv` refuses it alike."""
    modules = chain_modules([2, 2])
    modules[1].insert(0, modules[0][-1])
    plan = make_plan(tmp_path, layers=[2, 2], groups=2, group_size=1, config=["single", "single"], modules=modules)
    schedule, doc = read_plan(plan)
    why = refusal("torch", schedule, doc)
    assert why is not None and "is split between stages 0 and 1" in why and "whole layers" in why
    ok, err = exports(tmp_path, plan, "torch")
    assert not ok and err.strip() == f"opsched: error: {why}"
    whole = make_plan(tmp_path, layers=[2, 2], groups=2, group_size=1, config=["single", "single"], name="whole.json")
    assert refusal("torch", *read_plan(whole)) is None


@pytest.mark.parametrize("name", ["mixtral_batched_experts.dynamo.onnx", "clip.legacy.onnx",
                                  "deepseek_lm_2L_sh1_r4.dynamo.onnx"])
def test_the_search_for_a_whole_layer_runtime_places_whole_layers(name):
    """The blocks the placement MIP places for torch, Megatron-LM or torchtitan each hold whole numbered layers
    (a layer's blocks are in one of them), so no candidate can cut a layer; any still do not."""
    from helpers import real_export
    from opsched.model.coarsen import coarsen
    from opsched.model.onnx_import import import_onnx
    from opsched.upper.reduce import reduce_block_graph
    from opsched.upper.stages import LAYER_COMPONENT, layer_path

    bg = coarsen(import_onnx(str(real_export(name))))

    def layers_cut(members) -> int:
        held = {}
        for b, ids in members.items():
            for m in ids:
                path = layer_path(bg.nodes[m]["block"].name)
                if LAYER_COMPONENT.match(".".join(path.split(".")[-2:])):
                    held.setdefault(path, set()).add(b)
        assert held, "the export names no numbered layer"
        return sum(len(owners) > 1 for owners in held.values())

    assert layers_cut(reduce_block_graph(bg, bg.number_of_nodes(), whole_layers=True)[1]) == 0
    assert layers_cut(reduce_block_graph(bg, bg.number_of_nodes())[1]) > 0  # without it, layers are several blocks


def _random_plan(tmp_path: Path, rng: random.Random, k: int) -> Path:
    """A plan as `opsched plan` writes them, with each field the export reads drawn at random: depth, layers per
    stage, interleaving, method, per-stage configuration, batch, ZeRO, layers moved between stages."""
    groups = rng.choice([1, 2, 4])
    per_rank = rng.choice([1, 2]) if groups > 1 else 1
    stages = groups * per_rank
    group_size = 8 // groups
    method = rng.choice(["1f1b", "gpipe", "zb-h1"] if per_rank == 1 else ["interleaved-1f1b"])
    if groups == 1:
        method = "1f1b"
    layers = [rng.choice([1, 2, 3]) for _ in range(stages)]
    configs = [c for c in ("dp", "tp", "tp2.dp", "dp+mixed") if group_size >= 2 or c == "dp"]
    config = rng.choice(configs)
    name = {"dp": f"dp{group_size}", "tp": f"tp{group_size}", "tp2.dp": f"tp2.dp{group_size // 2}"}
    per_stage: list[str | None] = [name.get(config, f"dp{group_size}")] * stages
    if config == "dp+mixed":
        per_stage[rng.randrange(stages)] = rng.choice([None, f"tp{group_size}"])
    modules = None
    if stages > 1 and rng.random() < 0.3:  # a layer on two stages, as a block-level cut leaves it
        modules = chain_modules(layers)
        modules[1].insert(0, modules[0][-1])
    return make_plan(tmp_path, layers=layers, groups=groups, group_size=group_size, method=method, config=per_stage,
                     microbatch_size=rng.choice([1, 2, 4, 8]), microbatches=rng.choice([4, 6, 8]),
                     zero=rng.choice([0, 1, 2]), modules=modules, name=f"plan{k}.json")


def test_refusal_agrees_with_the_export_on_random_plans(tmp_path):
    """Property: for random plans, refusal() is None exactly when `opsched export` writes the runtime's files."""
    rng = random.Random(14)
    seen = {runtime: set() for runtime in RUNTIMES}
    for k in range(12):
        plan = _random_plan(tmp_path, rng, k)
        schedule, doc = read_plan(plan)
        for runtime, why in verdicts(schedule, doc).items():
            ok, err = exports(tmp_path, plan, runtime)
            assert (why is None) == ok, (k, runtime, why, err)
            seen[runtime].add(ok)
    # the draws reach both answers for the frameworks, so the agreement is not vacuous
    assert seen["megatron"] == {True, False} and seen["torchtitan"] == {True, False}


def test_the_schema_holds_runtimes_to_the_known_names(tmp_path):
    from opsched.plan.report import runtimes_fields

    plan = make_plan(tmp_path, layers=[16, 16], config="tp2.dp2", microbatch_size=4)
    schedule, doc = read_plan(plan)
    doc.update(runtimes_fields(verdicts(schedule, doc)))
    assert {"torch", "megatron", "torchtitan"} <= set(doc["runtimes"])  # a plain chain: all three run it
    assert sorted(doc["runtimes"] + list(doc["runtimes_refused"])) == sorted(RUNTIMES)  # every runtime answers
    assert schema_errors(doc) == []
    assert schema_errors(dict(doc, runtimes=["tpu"])) and schema_errors(dict(doc, runtimes_refused={"tpu": "no"}))


@pytest.mark.slow
def test_the_planner_returns_only_what_the_runtime_runs_and_says_why_it_left_the_rest_out():
    """Two towers: the placement MIP's best plan branches (the towers side by side); with runtime torch only a
    chain may win, and the branching candidates say why they were left out."""
    from opsched.cost.cluster import Training, cluster_from_dict
    from opsched.export.torch_csv import check_expressible
    from opsched.plan.search import PlanOptions, plan_block_graph
    from helpers import SLOW_LINK_CLUSTER
    from test_plan_cli import two_tower_graph

    # a time limit a loaded machine does not spend before every candidate is asked (the reasons are the point)
    result = plan_block_graph(two_tower_graph(), cluster_from_dict(SLOW_LINK_CLUSTER), Training(microbatches=4),
                              PlanOptions(time_limit=30, runtime="torch"))
    check_expressible(result.schedule.stage_graph, result.schedule.microbatches)  # a chain torch runs
    left_out = [c for c in result.candidates if c.status.startswith("not scheduled: ")]
    assert left_out and all("the StageGraph branches" in c.status for c in left_out)


# --------------------------------------------------------------------------- bad input


def test_an_unknown_runtime_is_refused_by_argparse(tmp_path, capsys):
    code = main(["plan", str(MODELS / "gpt_1_7b.onnx"), "--devices", "4", "--runtime", "tpu", "-o", str(tmp_path / "o")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "invalid choice: 'tpu'" in lines[-1] and not (tmp_path / "o").exists()


@pytest.mark.parametrize("runtime", ["megatron", "torchtitan"])
def test_a_model_with_two_layer_stacks_is_refused_before_the_search(runtime, tmp_path, capsys):
    """CLIP's two towers: no Megatron / torchtitan pipeline splits two stacks, known right after the import."""
    from helpers import real_export

    before = _snapshot(tmp_path)
    code = main(["plan", str(real_export("clip.legacy.onnx")), "--devices", "4", "--runtime", runtime,
                 "--time-limit", "30", "-o", str(tmp_path / "out")])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and captured.out == "", captured.err
    assert lines[0].startswith(f"opsched: error: --runtime {runtime}: ") and "2 stacks of numbered layers" in lines[0]
    assert "--runtime torch" in lines[0] and "upper:" not in captured.err
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
def test_no_runnable_plan_says_why_and_how_to_widen_the_search(tmp_path, capsys):
    """A static export (its batch found and rescaled): on 5 devices no Megatron-style layout fits and the planner's
    whole-layer plans use the devices unevenly; one line names the first reason and the way out, exit 2, nothing
    written. (On 4 devices its whole layers make a plan torchtitan runs.)"""
    from helpers import real_export

    model = str(real_export("deepseek_lm_2L_sh1_r4.dynamo.onnx"))
    assert main(["plan", model, "--devices", "4", "--time-limit", "2", "--runtime", "torchtitan",
                 "-o", str(tmp_path / "four"), "--quiet"]) == 0
    assert "torchtitan" in json.loads((tmp_path / "four" / "plan.json").read_text())["runtimes"]
    capsys.readouterr()
    before = _snapshot(tmp_path)
    # time enough for the layout search to end on its own (one cut short says so instead: the test below)
    code = main(["plan", model, "--devices", "5", "--time-limit", "20",
                 "--runtime", "torchtitan", "-o", str(tmp_path / "out"), "--quiet"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and captured.out == "", captured.err
    assert lines[0].startswith("opsched: error: no plan found can run on torchtitan (opsched export --torchtitan ")
    assert "no Megatron-style layout" in lines[0] and "fits: pass a larger --memory-limit or more --devices" in lines[0]
    assert lines[0].endswith("plan with --runtime any for the fastest plan of any shape")
    assert _snapshot(tmp_path) == before


def test_a_layout_search_cut_short_says_the_time_ran_out_not_that_nothing_fits(monkeypatch):
    """When the Megatron-style layout search ran out of time with none found, the refusal must not claim that no
    such layout fits (it may: the bug hunt saw Qwen3-30B on 40 devices refused so under load)."""
    import networkx as nx

    from opsched.cost.cluster import Training, preset
    from opsched.errors import NoRunnablePlan, OpschedError
    from opsched.plan import policy

    def refused(*args, **kwargs):
        raise NoRunnablePlan("no plan found can run on megatron (opsched export --megatron F): a reason", ["a reason"])

    monkeypatch.setattr(policy, "plan_block_graph", refused)
    request = policy.PlanRequest(model="m.onnx", time_limit=10, runtime="megatron", recompute="none")
    for cut, words in ((True, "share of the time limit ran out: pass a larger --time-limit"),
                       (False, "fits: pass a larger --memory-limit or more --devices")):
        with pytest.raises(OpschedError, match=words):
            policy.plan_with_recompute(request, nx.DiGraph(), preset("h100-sxm", 8), Training(), 8e10, 1e12, [],
                                       True, cut)


# --------------------------------------------------------------------------- end to end, one per runtime


def _plan(tmp_path: Path, runtime: str, *extra: str) -> tuple[Path, dict]:
    """Plan the bundled GPT 1.7B on 4 devices for ``runtime``: (the output directory, plan.json)."""
    out = tmp_path / "out"
    argv = ["plan", str(MODELS / "gpt_1_7b.onnx"), "--devices", "4", "--time-limit", "6", "--runtime", runtime,
            "-o", str(out), "--quiet", *extra]
    assert main(argv) == 0
    return out, json.loads((out / "plan.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_a_plan_for_a_runtime_exports_to_it(runtime, tmp_path, capsys):
    out, doc = _plan(tmp_path, runtime, "--json")
    summary = json.loads(capsys.readouterr().out)
    assert schema_errors(doc) == []
    assert runtime in doc["runtimes"] and doc["runtimes"] == summary["runtimes"]
    assert set(doc["runtimes"]) | set(doc["runtimes_refused"]) == set(RUNTIMES)
    report = (out / "report.md").read_text()
    assert "## Runtimes" in report and f"| {runtime} | yes | `opsched export plan.json {RUNTIMES[runtime].export_flags}` |" in report
    for other, why in doc["runtimes_refused"].items():
        assert f"| {other} | no | {why} |" in report
    code, stdout, err = export(tmp_path, out / "plan.json", *export_argv(runtime, tmp_path / "files"))
    assert code == 0, err
    if runtime == "megatron":
        config, training = megatron_config(megatron_argv(tmp_path / "files" / "F"), **LLAMA)
        assert config.tensor_model_parallel_size * config.pipeline_model_parallel_size <= 4
        assert int(training["--global-batch-size"]) == 16  # the plan's samples per step: 16 microbatches of 1


@pytest.mark.slow
def test_a_torchtitan_plan_loads_in_torchtitan(tmp_path, torchtitan_config):  # noqa: F811
    out, _doc = _plan(tmp_path, "torchtitan")
    code, _stdout, err = export(tmp_path, out / "plan.json", *export_argv("torchtitan", tmp_path / "files"))
    assert code == 0, err
    job, dims = torchtitan_config(tmp_path / "files" / "F.toml", 4)
    assert dims.dp_replicate * dims.dp_shard * dims.tp * dims.pp == 4
    assert job.training.global_batch_size == 16


@pytest.mark.slow
def test_llama_on_8_devices_plans_for_megatron_and_exports(tmp_path):
    """The issue's example: `plan models/llama_7b.onnx --devices 8 --runtime megatron` gives a plan that exports."""
    out = tmp_path / "out"
    assert main(["plan", str(MODELS / "llama_7b.onnx"), "--devices", "8", "--time-limit", "20", "--runtime",
                 "megatron", "-o", str(out), "--quiet"]) == 0
    code, _stdout, err = export(tmp_path, out / "plan.json", "--megatron", str(tmp_path / "m.sh"))
    assert code == 0, err
    megatron_config(megatron_argv(tmp_path / "m.sh"), **LLAMA)


def test_a_megatron_style_baseline_with_experts_says_ep_to_its_exports():
    """The Megatron-style baseline tp1 pp1 ep4 dp4: its stage's experts are expert-parallel over the group, so the
    configuration is dp4+ep and `export --megatron` writes --expert-model-parallel-size 4; before, the experts'
    mode counted as dense weights (dp4) and the export dropped ep, each rank then holding every expert."""
    from helpers import real_export
    from opsched.cost.cluster import Training, preset
    from opsched.cost.parallel_layout import ParallelLayout
    from opsched.model.coarsen import coarsen
    from opsched.model.onnx_import import import_onnx
    from opsched.plan.layouts import evaluate_layout
    from opsched.plan.policy import layout_row

    bg = coarsen(import_onnx(str(real_export("mixtral_batched_experts.dynamo.onnx"))))
    cluster = preset("h100-sxm", 4)
    e = evaluate_layout(bg, cluster, Training(microbatches=4), ParallelLayout.parse("pp=1,ep=4").resolved(4),
                        global_batch=8, micro_batch_size=1, tokens_per_sequence=16)
    assert {c: v.config for c, v in layout_row(e, bg, cluster, 0.0).contents.items()} == {0: "dp4+ep"}
    # experts over part of the group (ep2 of dp4) are no "+ep": the configuration is not one a framework sets
    e = evaluate_layout(bg, cluster, Training(microbatches=4), ParallelLayout.parse("pp=1,ep=2").resolved(4),
                        global_batch=8, micro_batch_size=1, tokens_per_sequence=16)
    assert layout_row(e, bg, cluster, 0.0).contents[0].config is None
