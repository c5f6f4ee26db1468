"""Tests of `opsched export --megatron / --torchtitan` (opsched/export/plan_layout.py, megatron.py, torchtitan.py).

What each framework takes is checked by the framework's own code where it is
installed (skipped cleanly where not): Megatron-Core's ``TransformerConfig``
(a ``ModelParallelConfig``) is built from the arguments file as bash reads it,
so its ``__post_init__`` checks run on it; torchtitan's ``ConfigManager``
loads the TOML (it refuses unknown keys) and its ``ParallelDims`` checks the
degrees against the world size. Every refusal is tested for its reason, a
single line, exit 2 and nothing written.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

from opsched.baselines import run_baseline
from opsched.schedule.placement import onto_groups
from opsched.cli import main
from opsched.export.plan_json import write_plan
from opsched.export.torch_csv import torch_available
from opsched.schedule import Edge, Job, Schedule, Stage, StageGraph, chain_stage_graph, simulate

# --------------------------------------------------------------------------- plans to export


def chain_modules(layers: list[int]) -> list[list[str]]:
    """The module paths of each stage of a Llama-style chain: ``layers[k]`` layers on stage k, the embedding on
    the first stage, the final norm and head on the last."""
    modules, first = [], 0
    for k, n in enumerate(layers):
        held = [f"model.layers.{i}" for i in range(first, first + n)]
        first += n
        modules.append((["model.embed_tokens"] if k == 0 else []) + held
                       + (["model.norm", "lm_head"] if k == len(layers) - 1 else []))
    return modules


def make_plan(
    tmp_path: Path,
    *,
    layers: list[int],
    groups: int = 2,
    group_size: int = 4,
    method: str = "1f1b",
    config: str | list[str | None] = "tp2.dp2",
    microbatch_size: int = 4,
    microbatches: int = 8,
    zero: int = 1,
    recompute: str = "none",
    seq: int | None = 4096,
    modules: list[list[str]] | None = None,
    name: str = "plan.json",
    optimizer_state: str | None = None,
    tp_comm_overlap: bool | None = None,
    attention: str | None = None,
    dtype: str | None = None,
    recompute_modules: list[str] | None = None,
) -> Path:
    """A plan.json as `opsched plan` writes one: ``method`` run on ``len(layers)`` stages over ``groups`` device
    groups of ``group_size`` devices, stage k holding ``layers[k]`` numbered layers (the embedding with the first,
    the final norm and the head with the last), every stage in ``config`` (or ``config[k]``)."""
    stages = len(layers)
    sg = chain_stage_graph(stages, devices=groups, placement="interleaved" if stages > groups else "chain")
    sched = run_baseline(method, sg, microbatches)
    sched = onto_groups(sched, [tuple(range(g * group_size, (g + 1) * group_size)) for g in range(groups)],
                        groups * group_size)
    if modules is None:
        modules = chain_modules(layers)
    configs = config if isinstance(config, list) else [config] * len(sched.stage_graph.stages)
    contents = {
        str(k): {"layers": ", ".join(mods), "modules": mods, "modes": {str(configs[k]).split("+")[0]: ", ".join(mods)},
                 "blocks": [f"{m.replace('.', '/')} [{configs[k]}]" for m in mods], "config": configs[k]}
        for k, mods in enumerate(modules)
    }
    extra = {"microbatch_size": microbatch_size, "zero": zero, "recompute": recompute, "stage_contents": contents,
             "dims": {"batch": microbatch_size} | ({"seq": seq} if seq else {})}
    if optimizer_state is not None:  # a plan from before opsched recorded it has none (fp32)
        extra["optimizer_state"] = optimizer_state
    if tp_comm_overlap is not None:  # nor this (exposed tensor-parallel collectives)
        extra["tp_comm_overlap"] = tp_comm_overlap
    if attention is not None:  # nor this (fused attention)
        extra["attention"] = attention
    if dtype is not None:  # nor this (bf16)
        extra["dtype"] = dtype
    if recompute_modules is not None:  # nor this (no recomputation by module)
        extra["recompute_modules"] = recompute_modules
    path = tmp_path / name
    write_plan(path, sched, extra=extra)
    return path


def export(tmp_path: Path, plan: Path, *flags: str) -> tuple[int, str, str]:
    """Run `opsched export PLAN FLAGS` in-process; (exit code, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["export", str(plan), *flags])
    return code, out.getvalue(), err.getvalue()


# --------------------------------------------------------------------------- Megatron


def megatron_argv(path: Path) -> list[str]:
    """The words the file's array holds, as bash reads them (the file is for bash, so bash reads it here)."""
    script = 'source "$1" && printf "%s\\n" "${OPSCHED_MEGATRON_ARGS[@]}"'
    done = subprocess.run(["bash", "-c", script, "bash", str(path)], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def flags_of(argv: list[str]) -> dict[str, str | list[str] | None]:
    """``--flag value`` words as a dict; a flag followed by another flag (or nothing) is a switch (None), one
    followed by several words takes them all (a list, as argparse's ``nargs="*"``)."""
    out: dict[str, str | list[str] | None] = {}
    k = 0
    while k < len(argv):
        assert argv[k].startswith("--"), argv[k]
        values = []
        while k + 1 + len(values) < len(argv) and not argv[k + 1 + len(values)].startswith("--"):
            values.append(argv[k + 1 + len(values)])
        out[argv[k]] = None if not values else values[0] if len(values) == 1 else values
        k += 1 + len(values)
    return out


#: Megatron-LM (core 0.16) flags written by hand in its arguments.py rather than generated from a config field's
#: name, and the TransformerConfig field each sets; None: a training argument, not a config field
MEGATRON_LM_FLAGS = {
    "--decoder-first-pipeline-num-layers": "num_layers_in_first_pipeline_stage",
    "--decoder-last-pipeline-num-layers": "num_layers_in_last_pipeline_stage",
    "--num-virtual-stages-per-pipeline-rank": "virtual_pipeline_model_parallel_size",
    "--pipeline-model-parallel-layout": "pipeline_model_parallel_layout",
    "--use-distributed-optimizer": None,
    "--micro-batch-size": None,
    "--global-batch-size": None,
    "--seq-length": None,
    **dict.fromkeys(("--use-precision-aware-optimizer", "--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype",
                     "--exp-avg-sq-dtype"), None),  # OptimizerConfig fields, not TransformerConfig's
}

#: the values Megatron-LM's arguments.py lets each precision-aware optimizer flag take (its ``choices``, read in
#: NVIDIA/Megatron-LM megatron/training/arguments.py at d98e8a6)
PRECISION_AWARE_CHOICES = {
    "--main-grads-dtype": ("fp32", "bf16"),
    "--main-params-dtype": ("fp32", "fp16"),
    "--exp-avg-dtype": ("fp32", "fp16", "bf16", "fp8"),
    "--exp-avg-sq-dtype": ("fp32", "fp16", "bf16", "fp8"),
}


def megatron_config(argv: list[str], **model):
    """Megatron-Core's own TransformerConfig from the exported flags plus the user's model fields.

    Config flags map to fields the way Megatron-LM's argument factory names
    them: the field's name with dashes, unless the field's metadata names the
    flag (``argparse_meta``); the few hand-written flags are in
    :data:`MEGATRON_LM_FLAGS`.
    """
    pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install 'opsched[megatron]'")
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    by_flag = {}
    for f in dataclasses.fields(TransformerConfig):
        names = f.metadata.get("argparse_meta", {}).get("arg_names") or ["--" + f.name.replace("_", "-")]
        for name in names:
            by_flag[name] = f
    fields, training = {}, {}
    for flag, value in flags_of(argv).items():
        if flag in MEGATRON_LM_FLAGS and MEGATRON_LM_FLAGS[flag] is None:
            training[flag] = value
            continue
        field = next(f for f in dataclasses.fields(TransformerConfig) if f.name == MEGATRON_LM_FLAGS[flag]) \
            if flag in MEGATRON_LM_FLAGS else by_flag.get(flag)
        assert field is not None, f"{flag} sets no TransformerConfig field"
        if field.name == "attention_backend":  # Megatron-LM parses it as AttnBackend[value]
            from megatron.core.transformer.enums import AttnBackend

            fields[field.name] = AttnBackend[value]
            continue
        if field.name == "recompute_modules":  # nargs="*": a list however many
            fields[field.name] = value if isinstance(value, list) else [value]
            continue
        fields[field.name] = True if value is None else value if field.name in (
            "recompute_granularity", "recompute_method", "pipeline_model_parallel_layout", "fp8", "fp8_recipe") \
            else int(value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron warns that Transformer Engine and Apex are missing
        config = TransformerConfig(pipeline_dtype=torch.bfloat16, **model, **fields)
    return config, training


LLAMA = {"hidden_size": 4096, "num_attention_heads": 32}
MIXTRAL = {"hidden_size": 4096, "num_attention_heads": 32, "num_moe_experts": 8, "moe_ffn_hidden_size": 14336}


def test_megatron_chain_with_uneven_first_and_last_stages(tmp_path):
    plan = make_plan(tmp_path, layers=[15, 17], config="tp2.dp2", microbatch_size=4, microbatches=8)
    code, out, err = export(tmp_path, plan, "--megatron", str(tmp_path / "m.sh"))
    assert code == 0, err
    assert "wrote" in out and "Megatron-LM arguments for 8 devices: pp 2 x (tp2.dp2)" in out
    argv = megatron_argv(tmp_path / "m.sh")
    config, training = megatron_config(argv, **LLAMA)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size) \
        == (2, 2, 1)
    assert config.sequence_parallel and config.num_layers == 32
    assert (config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage) == (15, 17)
    assert config.virtual_pipeline_model_parallel_size is None and config.recompute_granularity is None
    # a microbatch of 4 samples split over dp2: 2 per replica; 8 microbatches of 4 samples a step
    assert training == {"--use-distributed-optimizer": None, "--micro-batch-size": "2", "--global-batch-size": "32",
                        "--seq-length": "4096"}
    text = (tmp_path / "m.sh").read_text()
    assert text.startswith("# Megatron-LM arguments for the opsched plan")
    assert "not the plan's" not in text  # 1f1b is Megatron's own schedule


def test_megatron_even_split_interleaved_with_recomputation(tmp_path):
    plan = make_plan(tmp_path, layers=[4] * 8, groups=4, group_size=2, method="interleaved-1f1b", config="tp2",
                     microbatch_size=1, microbatches=8, zero=0, recompute="full")
    assert export(tmp_path, plan, "--megatron", str(tmp_path / "m.sh"))[0] == 0
    argv = megatron_argv(tmp_path / "m.sh")
    config, training = megatron_config(argv, **LLAMA)
    assert (config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size) == (4, 2)
    assert config.num_layers_in_first_pipeline_stage is None and config.num_layers == 32
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "uniform", 1)
    assert "--use-distributed-optimizer" not in training and training["--micro-batch-size"] == "1"


def test_megatron_uneven_interleaved_split_uses_first_and_last_rank_layers(tmp_path):
    # ranks 0..3 hold chunks (0, 4), (1, 5), (2, 6), (3, 7): the first rank 3 + 3, the middle 4 + 4, the last 4 + 4
    plan = make_plan(tmp_path, layers=[3, 4, 4, 4, 3, 4, 4, 4], groups=4, group_size=2, method="interleaved-1f1b",
                     config="dp2", microbatch_size=2, microbatches=8)
    assert export(tmp_path, plan, "--megatron", str(tmp_path / "m.sh"))[0] == 0
    config, _ = megatron_config(megatron_argv(tmp_path / "m.sh"), **LLAMA)
    assert (config.num_layers, config.virtual_pipeline_model_parallel_size) == (30, 2)
    assert (config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage) == (6, 8)


def test_megatron_any_other_split_is_a_pipeline_layout(tmp_path):
    plan = make_plan(tmp_path, layers=[2, 5, 6, 3], groups=4, group_size=2, config="tp2", microbatch_size=1)
    assert export(tmp_path, plan, "--megatron", str(tmp_path / "m.sh"))[0] == 0
    argv = megatron_argv(tmp_path / "m.sh")
    assert flags_of(argv)["--pipeline-model-parallel-layout"] == "Ett|t*5|t*6|t*3L"
    assert "--num-virtual-stages-per-pipeline-rank" not in argv  # Megatron-LM takes one or the other
    config, _ = megatron_config(argv, **LLAMA)  # Megatron checks the layout's layers add up to num_layers
    assert config.num_layers == 16 and config.pipeline_model_parallel_layout is not None


@pytest.mark.parametrize("config,tp,dp", [("dp4+ep", 1, 4), ("tp2.dp2+ep", 2, 2)])
def test_megatron_expert_parallel_over_the_whole_group(tmp_path, config, tp, dp):
    plan = make_plan(tmp_path, layers=[16, 16], config=config, microbatch_size=4)
    assert export(tmp_path, plan, "--megatron", str(tmp_path / "m.sh"))[0] == 0
    config_, training = megatron_config(megatron_argv(tmp_path / "m.sh"), **MIXTRAL)
    assert (config_.tensor_model_parallel_size, config_.expert_model_parallel_size,
            config_.expert_tensor_parallel_size) == (tp, 4, 1)
    assert config_.sequence_parallel == (tp > 1)
    assert training["--micro-batch-size"] == str(4 // dp)


def test_megatron_sets_the_plans_context_parallel_size(tmp_path):
    """A plan whose stages are tp2.cp2.dp2 (a Megatron-style layout with context parallelism) exports cp 2."""
    plan = make_plan(tmp_path, layers=[16, 16], group_size=8, config="tp2.cp2.dp2", microbatch_size=2, seq=65536)
    assert export(tmp_path, plan, "--megatron", str(tmp_path / "m.sh"))[0] == 0
    flags = flags_of(megatron_argv(tmp_path / "m.sh"))
    assert (flags["--context-parallel-size"], flags["--tensor-model-parallel-size"]) == ("2", "2")
    assert flags["--micro-batch-size"] == "1"  # one sequence per replica, split over the cp ranks
    config, _ = megatron_config(megatron_argv(tmp_path / "m.sh"), **LLAMA)
    assert (config.context_parallel_size, config.tensor_model_parallel_size) == (2, 2)


def test_torch_alone_refuses_a_context_parallel_plan_that_torchtitan_runs(tmp_path, torchtitan_config):
    plan = make_plan(tmp_path, layers=[16, 16], group_size=8, config="cp4.dp2", microbatch_size=2, seq=65536)
    code, _, err = export(tmp_path, plan, "--torch-csv", str(tmp_path / "s.csv"))
    assert code == 2 and len(err.splitlines()) == 1 and not (tmp_path / "s.csv").exists()
    assert "split each sequence over 4 context-parallel ranks (cp4.dp2)" in err and "--torchtitan" in err
    code, _, err = export(tmp_path, plan, "--torchtitan", str(tmp_path / "t.toml"), "--torch-csv",
                          str(tmp_path / "s.csv"))
    assert code == 0, err
    job, dims = torchtitan_config(tmp_path / "t.toml", 16)
    assert (dims.cp, dims.tp, dims.pp, dims.dp_replicate * dims.dp_shard) == (4, 1, 2, 2)
    assert job.training.seq_len == 65536


def test_megatron_keeps_adams_state_in_bf16_with_its_precision_aware_optimizer(tmp_path):
    """A plan costed with --optimizer-state bf16 (2 + 2 + 6 bytes per parameter) exports the flags that make
    Megatron hold that: bf16 moments and main grads, the fp32 master weight kept as 16-bit remainders."""
    plan = make_plan(tmp_path, layers=L16, optimizer_state="bf16")
    assert export(tmp_path, plan, "--megatron", str(tmp_path / "m.sh"))[0] == 0
    argv = megatron_argv(tmp_path / "m.sh")
    flags = flags_of(argv)
    assert "--use-distributed-optimizer" in flags and flags["--use-precision-aware-optimizer"] is None
    assert {f: flags[f] for f in PRECISION_AWARE_CHOICES} == {
        "--main-grads-dtype": "bf16", "--main-params-dtype": "fp32", "--exp-avg-dtype": "bf16",
        "--exp-avg-sq-dtype": "bf16"}
    assert all(flags[f] in choices for f, choices in PRECISION_AWARE_CHOICES.items())
    # a plan without the field (or fp32) writes none of them: Megatron's default optimizer
    default = make_plan(tmp_path, layers=L16, name="default.json")
    assert export(tmp_path, default, "--megatron", str(tmp_path / "d.sh"))[0] == 0
    assert not set(flags_of(megatron_argv(tmp_path / "d.sh"))) & {"--use-precision-aware-optimizer",
                                                                   *PRECISION_AWARE_CHOICES}
    megatron_config(argv, **LLAMA)  # the model-parallel flags still build Megatron-Core's TransformerConfig
    from megatron.core.optimizer import OptimizerConfig

    fields = {f.name for f in dataclasses.fields(OptimizerConfig)}  # Megatron-LM fills it from the flags' names
    assert {f.removeprefix("--").replace("-", "_") for f in ("--use-precision-aware-optimizer",
                                                             *PRECISION_AWARE_CHOICES)} <= fields


def test_megatron_overlaps_tensor_parallel_collectives_when_the_plan_was_costed_so(tmp_path):
    """A plan costed with --tp-comm-overlap (tp2 with sequence parallelism) exports Megatron's flag, which
    Megatron-Core's TransformerConfig accepts with sequence parallelism; torch's runtime alone refuses the plan,
    and a plan without tensor parallelism exports no flag (it has nothing to overlap)."""
    plan = make_plan(tmp_path, layers=L16, tp_comm_overlap=True)
    assert export(tmp_path, plan, "--megatron", str(tmp_path / "m.sh"))[0] == 0
    argv = megatron_argv(tmp_path / "m.sh")
    flags = flags_of(argv)
    assert flags["--tp-comm-overlap"] is None and flags["--sequence-parallel"] is None
    config, _ = megatron_config(argv, **LLAMA)
    assert config.tp_comm_overlap and config.sequence_parallel
    code, _, err = export(tmp_path, plan, "--torch-csv", str(tmp_path / "s.csv"))
    assert code == 2 and len(err.splitlines()) == 1 and not (tmp_path / "s.csv").exists()
    assert "(tp2.dp2) are costed as running under their GEMMs" in err and "--tp-comm-overlap off" in err
    for config_name, overlap in (("dp4", True), ("tp2.dp2", None)):  # nothing to overlap; an older plan
        other = make_plan(tmp_path, layers=L16, config=config_name, tp_comm_overlap=overlap, name=f"{config_name}.json")
        assert export(tmp_path, other, "--megatron", str(tmp_path / f"{config_name}.sh"))[0] == 0
        assert "--tp-comm-overlap" not in flags_of(megatron_argv(tmp_path / f"{config_name}.sh"))


def test_megatron_runs_attention_unfused_when_the_plan_was_costed_so(tmp_path):
    """A plan costed with --attention unfused exports Megatron-Core's unfused attention backend, which its
    TransformerConfig takes; a fused plan, or one from before the field, leaves Megatron's default backend."""
    pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install 'opsched[megatron]'")
    from megatron.core.transformer.enums import AttnBackend

    plan = make_plan(tmp_path, layers=L16, attention="unfused")
    assert export(tmp_path, plan, "--megatron", str(tmp_path / "m.sh"))[0] == 0
    argv = megatron_argv(tmp_path / "m.sh")
    assert flags_of(argv)["--attention-backend"] == "unfused"
    config, _ = megatron_config(argv, **LLAMA)
    assert config.attention_backend == AttnBackend.unfused
    for attention in ("fused", None):
        other = make_plan(tmp_path, layers=L16, attention=attention, name=f"{attention}.json")
        assert export(tmp_path, other, "--megatron", str(tmp_path / f"{attention}.sh"))[0] == 0
        assert "--attention-backend" not in flags_of(megatron_argv(tmp_path / f"{attention}.sh"))
    bad = make_plan(tmp_path, layers=L16, attention="flash", name="bad.json")
    code, _, err = export(tmp_path, bad, "--megatron", str(tmp_path / "bad.sh"))
    assert code == 2 and "field attention is 'flash'; one of fused, unfused" in err and not (tmp_path / "bad.sh").exists()


def test_megatron_says_when_it_runs_another_order_than_the_plan(tmp_path):
    plan = make_plan(tmp_path, layers=[16, 16], method="zb-h1")
    assert export(tmp_path, plan, "--megatron", str(tmp_path / "m.sh"))[0] == 0
    assert "Megatron runs its 1F1B on this layout, not the plan's zb-h1 order" in (tmp_path / "m.sh").read_text()


def test_the_pipeline_layout_text_is_megatrons():
    pytest.importorskip("megatron.core", reason="megatron-core is an optional extra")
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from opsched.export.megatron import pipeline_layout_text

    layout = PipelineParallelLayerLayout.from_str(pipeline_layout_text([1, 0, 3, 2]), pipeline_model_parallel_size=2)
    assert layout.virtual_pipeline_model_parallel_size == 2
    layout.validate_layer_layout(num_layers=6, mtp_num_layers=None)


# --------------------------------------------------------------------------- torchtitan


@pytest.fixture
def torchtitan_config():
    """torchtitan's ConfigManager and ParallelDims, loaded without running ``torchtitan/__init__.py``.

    That file registers torchtitan's quantization converters, whose MoE
    kernels import triton (a 250 MB GPU compiler); the configuration loader
    itself needs only tyro and torch, so the package is entered below its
    ``__init__``. The loader's code runs unchanged.
    """
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or spec.submodule_search_locations is None:
        pytest.skip("torchtitan is an optional extra: pip install 'opsched[torchtitan]'")
    pytest.importorskip("tyro", reason="torchtitan's configuration loader needs tyro")
    saved = {k: v for k, v in sys.modules.items() if k == "torchtitan" or k.startswith("torchtitan.")}
    package = types.ModuleType("torchtitan")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["torchtitan"] = package
    try:
        from torchtitan.config import ConfigManager
        from torchtitan.distributed.parallel_dims import ParallelDims

        def load(path: Path, devices: int):
            job = ConfigManager().parse_args(["--job.config_file", str(path)])
            p = job.parallelism
            dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                                cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
                                pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
                                etp=p.expert_tensor_parallel_degree, world_size=devices)
            return job, dims

        yield load
    finally:
        for k in [k for k in sys.modules if k == "torchtitan" or k.startswith("torchtitan.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_torchtitan_named_schedule_with_fsdp(tmp_path, torchtitan_config):
    plan = make_plan(tmp_path, layers=[15, 17], config="tp2.dp2", microbatch_size=4, microbatches=8)
    code, out, err = export(tmp_path, plan, "--torchtitan", str(tmp_path / "t.toml"))
    assert code == 0, err
    assert "torch's 1F1B schedule" in out
    job, dims = torchtitan_config(tmp_path / "t.toml", 8)
    p, t = job.parallelism, job.training
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp, dims.ep) == (1, 2, 2, 2, 1, 1)
    assert p.fsdp_reshard_after_forward == "never" and p.pipeline_parallel_schedule == "1F1B"
    assert not p.pipeline_parallel_schedule_csv
    # 8 microbatches of 2 samples per replica: torchtitan makes local / microbatch size = 8 microbatches
    assert (t.local_batch_size, p.pipeline_parallel_microbatch_size, t.global_batch_size, t.seq_len) == (16, 2, 32, 4096)
    assert [len(m) for m in p.module_fqns_per_model_part] == [16, 19]
    assert p.module_fqns_per_model_part[0][:2] == ["tok_embeddings", "layers.0"]
    assert p.module_fqns_per_model_part[1][-3:] == ["layers.31", "norm", "output"]
    assert job.activation_checkpoint.mode == "none"


def test_torchtitan_runs_the_plans_order_from_the_csv(tmp_path, torchtitan_config):
    plan = make_plan(tmp_path, layers=[4, 4, 4, 4], groups=2, group_size=2, method="zb-v", config="dp2",
                     microbatch_size=2, microbatches=4, zero=0, recompute="full")
    _edited(plan, lambda doc: doc.update(method="mip"))  # an order no torch schedule has by name
    code, _, err = export(tmp_path, plan, "--torchtitan", str(tmp_path / "t.toml"))
    assert code == 2 and "add --torch-csv" in err and not (tmp_path / "t.toml").exists()
    code, out, err = export(tmp_path, plan, "--torchtitan", str(tmp_path / "t.toml"),
                            "--torch-csv", str(tmp_path / "s.csv"))
    assert code == 0, err
    job, dims = torchtitan_config(tmp_path / "t.toml", 4)
    p = job.parallelism
    assert p.pipeline_parallel_schedule_csv == str((tmp_path / "s.csv").resolve())
    assert p.pipeline_parallel_schedule == "ZBVZeroBubble"  # it places the four stages in a V, as the plan does
    assert (dims.dp_replicate, dims.dp_shard, dims.pp) == (2, 1, 2)  # zero 0: DDP
    assert job.activation_checkpoint.mode == "full"
    if torch_available():  # the file torchtitan will load, loaded by torch's own loader
        from opsched.export.torch_csv import load_with_torch

        assert load_with_torch(p.pipeline_parallel_schedule_csv, num_stages=4, microbatches=4).pipeline_order


def test_torchtitan_expert_parallel_takes_fsdp_ranks(tmp_path, torchtitan_config):
    plan = make_plan(tmp_path, layers=[16, 16], config="tp2.dp2+ep", microbatch_size=2, zero=0)
    assert export(tmp_path, plan, "--torchtitan", str(tmp_path / "t.toml"))[0] == 0
    job, dims = torchtitan_config(tmp_path / "t.toml", 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.ep, dims.etp) == (1, 2, 2, 4, 1)
    assert job.parallelism.pipeline_parallel_microbatch_size == 1


def test_torchtitan_without_a_pipeline_accumulates_microbatches(tmp_path, torchtitan_config):
    plan = make_plan(tmp_path, layers=[32], groups=1, group_size=8, config="dp8", microbatch_size=8,
                     microbatches=4, seq=None)
    assert export(tmp_path, plan, "--torchtitan", str(tmp_path / "t.toml"))[0] == 0
    job, dims = torchtitan_config(tmp_path / "t.toml", 8)
    assert (dims.dp_shard, dims.pp) == (8, 1)
    assert (job.training.local_batch_size, job.training.global_batch_size) == (1, 32)
    assert job.parallelism.module_fqns_per_model_part is None and job.training.seq_len == 2048  # left to the user


def test_the_toml_is_toml_without_torchtitan(tmp_path):
    import tomllib

    plan = make_plan(tmp_path, layers=[16, 16], config="tp4", microbatch_size=1)
    assert export(tmp_path, plan, "--torchtitan", str(tmp_path / "t.toml"))[0] == 0
    doc = tomllib.loads((tmp_path / "t.toml").read_text())
    assert set(doc) == {"training", "parallelism", "activation_checkpoint"}
    assert doc["parallelism"]["tensor_parallel_degree"] == 4


# --------------------------------------------------------------------------- refusals


def _branching_plan(tmp_path: Path) -> Path:
    t = {"F": 1.0, "I": 1.0, "W": 1.0}
    sg = StageGraph([Stage(0, (0,), t), Stage(1, (1,), t), Stage(2, (2,), t)], [Edge(0, 1), Edge(0, 2)], num_devices=3)
    order = {0: [Job(0, 0, "F"), Job(0, 0, "B")], 1: [Job(1, 0, "F"), Job(1, 0, "B")], 2: [Job(2, 0, "F"), Job(2, 0, "B")]}
    path = tmp_path / "plan.json"
    write_plan(path, Schedule(sg, 1, simulate(sg, order, 1), name="mip"))
    return path


def _dualpipe_plan(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    write_plan(path, run_baseline("dualpipe", chain_stage_graph(2), 4))
    return path


def _edited(path: Path, edit) -> Path:
    """``path`` after ``edit(doc)`` changed its JSON document."""
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    return path


def _plan_without(field: str):
    def drop(doc: dict) -> None:
        if field == "config":
            for entry in doc["stage_contents"].values():
                del entry["config"]
        else:
            del doc[field]

    return lambda tmp_path: _edited(make_plan(tmp_path, layers=[16, 16]), drop)


def _p(**kw):
    return lambda tmp_path: make_plan(tmp_path, **kw)


L16 = [16, 16]
BOTH = ("megatron", "torchtitan")
#: case -> (plan maker, framework -> words of its reason); a framework not named takes the plan
REFUSALS = {
    "branching stage graph": (_branching_plan, dict.fromkeys(BOTH, "only runs a chain")),
    "DualPipe's two copies": (_dualpipe_plan, dict.fromkeys(BOTH, "runs only microbatches")),
    "modes differ inside a stage": (
        _p(layers=L16, config=["dp4", None]), dict.fromkeys(BOTH, "stage 1 runs its blocks with weights in")),
    "modes differ between stages": (
        _p(layers=L16, config=["dp4", "tp2.dp2"]), dict.fromkeys(BOTH, "stage 0: dp4, stage 1: tp2.dp2")),
    "dp does not divide the microbatch": (
        _p(layers=L16, config="dp4", microbatch_size=2), dict.fromkeys(BOTH, "--dim batch=4")),
    "a layer split between stages": (
        _p(layers=L16, modules=[["model.layers.0", "model.layers.1"], ["model.layers.1", "model.layers.2"]]),
        dict.fromkeys(BOTH, "model.layers.1 is split between stages 0 and 1")),
    "layers out of model order": (
        _p(layers=L16, modules=[["model.layers.2", "model.layers.3"], ["model.layers.0", "model.layers.1"]]),
        dict.fromkeys(BOTH, "stage 1 holds model.layers.0-1, out of model order")),
    "a layer no stage holds": (
        _p(layers=L16, modules=[["model.layers.0"], ["model.layers.2"]]), dict.fromkeys(BOTH, "no stage holds model.layers.1")),
    "two layer stacks": (
        _p(layers=L16, modules=[["vision.layers.0"], ["model.layers.0"]]), dict.fromkeys(BOTH, "2 stacks of numbered layers")),
    "a module outside the stack mid-pipeline": (
        _p(layers=[1, 1, 1, 1], groups=4, group_size=2, config="dp2", microbatch_size=2,
           modules=[["model.layers.0"], ["model.rotary_emb", "model.layers.1"], ["model.layers.2"], ["model.layers.3"]]),
        dict.fromkeys(BOTH, "stage 1 holds model.rotary_emb beside its layers")),
    "no stage_contents": (_plan_without("stage_contents"), dict.fromkeys(BOTH, "no stage_contents")),
    "no config (an older plan)": (_plan_without("config"), dict.fromkeys(BOTH, "has no config")),
    "no microbatch_size": (_plan_without("microbatch_size"), dict.fromkeys(BOTH, "no microbatch_size")),
    "stages in a V": (_p(layers=[8] * 4, groups=2, group_size=4, method="zb-v"), {"megatron": "sit in a V"}),
    "zero 2": (_p(layers=L16, zero=2), {"megatron": "plan with --zero 1"}),
    "interleaved microbatches not a multiple of pp": (
        _p(layers=[4] * 8, groups=4, group_size=2, method="interleaved-1f1b", config="dp2", microbatch_size=2,
           microbatches=6), {"megatron": "plan with --microbatches 8"}),
    "an order with no torch schedule name": (_p(layers=L16, method="zb-h1"), {"torchtitan": "add --torch-csv"}),
    "Adam's state in bf16": (_p(layers=L16, optimizer_state="bf16"), {"torchtitan": "plan with --optimizer-state fp32"}),
    "Adam's state in bf16 without zero 1": (
        _p(layers=L16, zero=0, optimizer_state="bf16"),
        {"megatron": "precision-aware optimizer runs only with its distributed optimizer: plan with --zero 1",
         "torchtitan": "fused_opt_states_bf16 keeps fp32 weights and gradients"}),
    "tensor-parallel collectives under their GEMMs": (
        _p(layers=L16, tp_comm_overlap=True), {"torchtitan": "plan with --tp-comm-overlap off, or export it --megatron"}),
    "a tp_comm_overlap that is no boolean": (
        _p(layers=L16, tp_comm_overlap="yes"), dict.fromkeys(BOTH, "field tp_comm_overlap is 'yes'; true or false")),
    "an unknown optimizer state": (
        _p(layers=L16, optimizer_state="fp8"), dict.fromkeys(BOTH, "field optimizer_state is 'fp8'; one of fp32, bf16")),
    "a sequence context parallelism cannot split in 2 x cp chunks": (
        _p(layers=L16, config="tp2.cp2", seq=4098), dict.fromkeys(BOTH, "does not split into 2 x cp = 4 equal")),
}
if torch_available():  # a plan whose method says DualPipeV but has fewer microbatches than stages (hand-edited)
    REFUSALS["torch's schedule refuses the microbatches"] = (
        lambda tmp_path: _edited(make_plan(tmp_path, layers=[8] * 4, groups=2, group_size=4, method="zb-v",
                                           microbatches=2), lambda doc: doc.update(method="dualpipev")),
        {"megatron": "sit in a V", "torchtitan": "DualPipeV requires at least as many microbatches as stages"})


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("framework", ["megatron", "torchtitan"])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_plan_the_framework_cannot_run_is_refused_in_one_line(tmp_path, case, framework):
    make, reasons = REFUSALS[case]
    plan = make(tmp_path)
    before = _snapshot(tmp_path)
    out = tmp_path / "out" / ("t.toml" if framework == "torchtitan" else "m.sh")
    code, stdout, err = export(tmp_path, plan, f"--{framework}", str(out))
    if framework not in reasons:
        assert code == 0, err
        return
    words = reasons[framework]
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and stdout == "", err
    name = "Megatron-LM" if framework == "megatron" else "torchtitan"
    assert lines[0].startswith(f"opsched: error: {name} cannot run this plan: "), lines[0]
    assert words in lines[0], lines[0]
    assert _snapshot(tmp_path) == before and not out.parent.exists()


def test_a_refused_output_writes_none_of_the_others(tmp_path):
    plan = make_plan(tmp_path, layers=[8] * 4, groups=2, group_size=4, method="zb-v")  # Megatron refuses a V
    code, _, err = export(tmp_path, plan, "--torch-csv", str(tmp_path / "s.csv"), "--torchtitan",
                          str(tmp_path / "t.toml"), "--megatron", str(tmp_path / "m.sh"))
    assert code == 2 and "sit in a V" in err
    assert not any((tmp_path / n).exists() for n in ("s.csv", "t.toml", "m.sh"))


@pytest.mark.parametrize("flags,words", [
    ([], "an output is required: --torch-csv FILE.csv, --megatron FILE or --torchtitan FILE.toml"),
    (["--megatron", "{tmp}/a", "--torchtitan", "{tmp}/a"], "--megatron writes there too"),
    (["--megatron", "{plan}"], "is the input"),
    (["--torchtitan", "{tmp}"], "is a directory"),
])
def test_export_flags_are_checked_before_the_plan_is_read(tmp_path, flags, words):
    plan = make_plan(tmp_path, layers=L16)
    before = _snapshot(tmp_path)
    code, _, err = export(tmp_path, plan, *[f.format(tmp=tmp_path, plan=plan) for f in flags])
    assert code == 2 and len(err.splitlines()) == 1 and words in err, err
    assert _snapshot(tmp_path) == before


def test_export_help_explains_both_frameworks(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = capsys.readouterr().out
    for words in ("--megatron FILE", "--torchtitan FILE.toml", "OPSCHED_MEGATRON_ARGS", "pipeline_parallel_schedule_csv",
                  "docs/export.md", "nothing is written"):
        assert words in text, words


# --------------------------------------------------------------------------- what plan.json says of each stage


def test_the_planner_names_each_stages_configuration_from_the_blocks_with_weights():
    """A merged block in ep2 holds attention (weights), a softmax (none) and two experts: the experts make the
    stage ``dp2+ep``, the attention's weights in an expert-parallel block run data-parallel (dp2)."""
    import networkx as nx

    from opsched.model.graph import Block
    from opsched.plan.runtime_filter import _stage_contents

    bg = nx.DiGraph(kind="BlockGraph")
    blocks = [Block(0, "model/layers.0/attn", (), ("q",), param_count=10),
              Block(1, "model/layers.0/attn#1", (), ("softmax",)),
              Block(2, "model/layers.0/mlp/experts.0", (), ("model/layers.0/mlp/experts.0/w1",), param_count=10),
              Block(3, "model/layers.0/mlp/experts.1", (), ("model/layers.0/mlp/experts.1/w1",), param_count=10),
              Block(4, "lm_head", (), ("head",), param_count=10)]
    for b in blocks:
        bg.add_node(b.id, block=b)
    members = {7: [0, 1, 2, 3], 4: [4]}  # block 7 of the reduced graph stands for 0-3
    contents = _stage_contents({0: [(7, "ep2"), (4, "dp2")], 1: [(7, "ep2"), (4, "tp2")]}, members, bg)
    assert contents[0].config == "dp2+ep"
    assert contents[1].config is None and contents[1].modes == {"ep2": "model.layers.0", "tp2": "lm_head"}


def test_selective_recomputation_is_megatrons_and_refused_by_torchtitan(tmp_path):
    """Megatron's selective recompute is the attention core's (what opsched costs); torchtitan's selective modes are
    other things, so a plan with it is refused there with one line."""
    plan = make_plan(tmp_path, layers=[8] * 4, groups=4, group_size=2, method="1f1b", config="tp2",
                     microbatch_size=1, microbatches=8, zero=1, recompute="selective")
    assert export(tmp_path, plan, "--megatron", str(tmp_path / "m.sh"))[0] == 0
    config, _ = megatron_config(megatron_argv(tmp_path / "m.sh"), **LLAMA)
    assert config.recompute_granularity == "selective" and config.recompute_method is None
    code, _, err = export(tmp_path, plan, "--torchtitan", str(tmp_path / "t.toml"))
    assert code == 2 and "selective recomputation" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t.toml").exists()


def test_megatron_recomputes_the_plans_modules_and_torchtitan_refuses_them(tmp_path):
    """A Megatron-style layout that recomputes by module (recompute_modules=layernorm+mlp) is exported as Megatron's
    selective recompute of those modules, which Megatron-Core's own config takes; torchtitan has no such setting."""
    plan = make_plan(tmp_path, layers=[8] * 4, groups=4, group_size=2, method="1f1b", config="tp2",
                     microbatch_size=1, microbatches=8, recompute_modules=["layernorm", "mlp"])
    assert export(tmp_path, plan, "--megatron", str(tmp_path / "m.sh"))[0] == 0
    argv = megatron_argv(tmp_path / "m.sh")
    assert argv[argv.index("--recompute-modules") + 1:][:2] == ["layernorm", "mlp"]
    config, _ = megatron_config(argv, **LLAMA)
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["layernorm", "mlp"]
    code, _, err = export(tmp_path, plan, "--torchtitan", str(tmp_path / "t.toml"))
    assert code == 2 and "layernorm, mlp" in err and len(err.strip().splitlines()) == 1
    bad = make_plan(tmp_path, layers=[16, 16], config="tp2.dp2", recompute_modules=["attention"], name="bad.json")
    code, _, err = export(tmp_path, bad, "--megatron", str(tmp_path / "b.sh"))
    assert code == 2 and "recompute_modules" in err and not (tmp_path / "b.sh").exists()


@pytest.mark.parametrize("dtype, words", [("bf16", {"bf16": True, "fp8": None}),
                                          ("fp8", {"bf16": True, "fp8": "e4m3", "fp8_recipe": "blockwise"}),
                                          ("fp16", {"fp16": True, "bf16": False}),
                                          ("fp32", {"bf16": False, "fp16": False, "fp8": None})])
def test_megatron_computes_in_the_plans_dtype(tmp_path, dtype, words):
    plan = make_plan(tmp_path, layers=[16, 16], config="tp2.dp2", dtype=dtype)
    assert export(tmp_path, plan, "--megatron", str(tmp_path / "m.sh"))[0] == 0
    config, _ = megatron_config(megatron_argv(tmp_path / "m.sh"), **LLAMA)
    assert {k: getattr(config, k) for k in words} == words


def test_torchtitan_computes_in_the_plans_dtype_and_refuses_fp16(tmp_path):
    plan = make_plan(tmp_path, layers=[16, 16], config="dp4", dtype="fp8", zero=1)
    code, _, err = export(tmp_path, plan, "--torchtitan", str(tmp_path / "t.toml"))
    assert code == 0, err
    import tomllib

    written = tomllib.loads((tmp_path / "t.toml").read_text())
    assert written["model"]["converters"] == ["quantize.linear.float8"]
    assert written["training"]["mixed_precision_param"] == "bfloat16"
    plan = make_plan(tmp_path, layers=[16, 16], config="dp4", dtype="fp16", zero=1, name="fp16.json")
    code, _, err = export(tmp_path, plan, "--torchtitan", str(tmp_path / "t16.toml"))
    assert code == 2 and "costed in fp16" in err and not (tmp_path / "t16.toml").exists()
