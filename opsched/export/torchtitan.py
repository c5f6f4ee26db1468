"""torchtitan job configuration for a plan (``opsched export PLAN --torchtitan FILE.toml``).

The file holds the ``[training]``, ``[parallelism]`` and
``[activation_checkpoint]`` keys a plan decides, in torchtitan's TOML job
format (``--job.config_file FILE.toml``, torchtitan 0.1 and 0.2; torchtitan
0.3 builds its configuration in Python instead and takes the same keys as
``--parallelism.KEY VALUE`` overrides). The user merges them into the model's
own file ([model], [optimizer], ...). docs/export.md has the mapping.

* **degrees**: tensor / pipeline / context / expert parallel as the plan's
  configuration sets them; the data-parallel replicas are DDP
  (``data_parallel_replicate_degree``) for a plan without ZeRO, else FSDP
  (``data_parallel_shard_degree``) that keeps the gathered weights from the
  forward to the backward (``fsdp_reshard_after_forward = "never"``), as
  ZeRO-1 and 2 keep them; FSDP too for an expert-parallel plan, since
  torchtitan's expert parallelism takes its ranks from the FSDP ones;
* **the split**: ``module_fqns_per_model_part``, each stage's modules named
  as torchtitan's decoder models name them (``tok_embeddings``,
  ``layers.N``, ``norm``, ``output``);
* **the schedule**: with ``csv`` the plan's own order from the torch CSV
  opsched writes (``pipeline_parallel_schedule_csv``), the schedule name
  then only telling torchtitan how the stages are placed; else torch's
  schedule of the plan's method (1f1b, gpipe, interleaved-1f1b, zb-v,
  dualpipev); a plan made by another method (the MIP's order, zb-h1, ...)
  needs the CSV and is refused without it;
* **the batch**: ``pipeline_parallel_microbatch_size`` is one replica's
  share of a microbatch, ``local_batch_size`` the microbatches of a step
  (one microbatch without a pipeline: torchtitan accumulates the rest),
  ``global_batch_size`` the plan's samples per step, ``seq_len`` its seq dim.

>>> from opsched.cost.parallel_layout import ParallelLayout
>>> from opsched.export.plan_layout import PlanLayout
>>> lay = PlanLayout(ParallelLayout(tp=2, pp=2, dp=2, sp=True, zero=1), "chain", "tp2.dp2", "model.layers", (1, 1),
...                  (("model.layers.0",), ("model.layers.1",)), 2, 8, 32, 4096, "1f1b", 8)
>>> keys = {f"{k.section}.{k.key}": k.value for k in torchtitan_keys(lay)}
>>> keys["parallelism.data_parallel_shard_degree"], keys["parallelism.pipeline_parallel_schedule"]
(2, '1F1B')
>>> keys["parallelism.module_fqns_per_model_part"]
[['tok_embeddings', 'layers.0'], ['layers.1', 'norm', 'output']]
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from typing import Union

from opsched.baselines import METHODS
from opsched.export.framework import Framework
from opsched.export.plan_layout import PlanLayout, plan_layout
from opsched.schedule import Schedule
from opsched.units import plural

TORCHTITAN = Framework("torchtitan", "use DualPipeV, which torchtitan runs")

#: opsched's methods whose order torch's schedule of that name runs (torch.distributed.pipelining.get_schedule_class)
TORCH_SCHEDULES = {name: module.TORCH_SCHEDULE for name, module in METHODS.items() if module.TORCH_SCHEDULE}

#: with a CSV, the schedule name only tells torchtitan how to place the stages: a V for ZBVZeroBubble and
#: DualPipeV, rank c mod pp otherwise; one stage per rank is a single-stage schedule
PLACEMENT_SCHEDULES = {"chain": "1F1B", "interleaved": "Interleaved1F1B", "v": "ZBVZeroBubble"}
_PLACEMENT_OF = {"1F1B": "chain", "GPipe": "chain", "Interleaved1F1B": "interleaved", "ZBVZeroBubble": "v",
                 "DualPipeV": "v"}

TomlValue = Union[int, str, bool, list]


@dataclass(frozen=True)
class TomlKey:
    """One key of the file: its section, name and value, and what in the plan it comes from."""

    section: str
    key: str
    value: TomlValue
    source: str


def _check_training(layout: PlanLayout) -> None:
    """Refuse a plan costed with training settings torchtitan has no equivalent of (one line saying which)."""
    p = layout.parallel
    if p.recompute == "selective":
        # torchtitan's selective modes checkpoint every n-th layer or chosen ops, not the attention core alone
        raise TORCHTITAN.cannot_run("its selective recomputation runs the attention "
                           "core again (Megatron's); torchtitan's selective modes recompute other things: plan with "
                           "--recompute none or full")
    if p.recompute_modules:
        raise TORCHTITAN.cannot_run(f"it recomputes Megatron's modules {', '.join(p.recomputed_modules)}; torchtitan's "
                                    "activation checkpointing is by layer or by op, not by these modules: plan with "
                                    "--recompute none or full, or export it --megatron")
    if p.tp_overlap:
        # torchtitan's async tensor parallel (a compiler pass, with torch.compile) is another mechanism, not costed
        raise TORCHTITAN.cannot_run("its tensor-parallel collectives are costed as "
                           "running under their GEMMs (Megatron's --tp-comm-overlap, Transformer Engine's "
                           "userbuffers), which torchtitan does not do: plan with --tp-comm-overlap off, or export "
                           "it --megatron")
    if layout.dtype == "fp16":
        raise TORCHTITAN.cannot_run("it was costed in fp16, and torchtitan's mixed "
                           "precision takes bfloat16 or float32 only: plan with --dtype bf16, or export it --megatron")
    if layout.optimizer_state != "fp32":
        # torchtitan's optimizer.implementation "fused_opt_states_bf16" keeps the moments in bf16 beside fp32
        # parameters and gradients: 4 + 4 + 2 + 2 = 12 bytes per parameter where the plan costs 2 + 2 + 6 = 10
        raise TORCHTITAN.cannot_run(f"it keeps Adam's state in {layout.optimizer_state} "
                           "with the master weight as 16-bit remainders of the bf16 weight (Megatron's precision-aware "
                           "optimizer); torchtitan's fused_opt_states_bf16 keeps fp32 weights and gradients, 2 bytes "
                           "more per parameter: plan with --optimizer-state fp32, or export it --megatron")


def torchtitan_keys(layout: PlanLayout, csv: str | None = None) -> list[TomlKey]:
    """The keys that set ``layout`` in torchtitan, or :class:`OpschedError` for a plan it cannot run.

    ``csv`` is the path the TOML names for the plan's own order (a torch CSV
    written beside it), None to use torch's schedule of the plan's method.
    """
    _check_training(layout)
    p = layout.parallel
    schedule = _schedule(layout, csv)
    key = TomlKey
    samples = layout.global_batch_size // layout.microbatches
    pipelined = p.pp > 1
    out = [
        key("training", "local_batch_size", layout.microbatches * layout.micro_batch_size if pipelined
            else layout.micro_batch_size,
            f"{plural(layout.microbatches, 'microbatch', 'microbatches')} of {layout.micro_batch_size} per replica"
            if pipelined else "one microbatch per replica; torchtitan accumulates gradients over the rest"),
        key("training", "global_batch_size", layout.global_batch_size,
            f"{plural(layout.microbatches, 'microbatch', 'microbatches')} x {plural(samples, 'sample')} per step"),
    ]
    if layout.seq_len is not None:
        out.append(key("training", "seq_len", layout.seq_len, "the plan's seq dim"))
    fsdp = (p.zero > 0 and p.dp > 1) or p.ep > 1  # one replica has nothing to shard
    if fsdp:
        why = f"zero {p.zero}: FSDP over the dp{p.dp} replicas" if p.zero else \
            "torchtitan's expert parallelism takes its ranks from FSDP's"
        out += [
            key("parallelism", "data_parallel_replicate_degree", 1, "no plain replicas"),
            key("parallelism", "data_parallel_shard_degree", p.dp, why),
            key("parallelism", "fsdp_reshard_after_forward", "always" if p.zero == 3 else "never",
                "FSDP full shard (zero 3)" if p.zero == 3 else "weights kept from forward to backward, as ZeRO-1/2"),
        ]
    else:
        out += [
            key("parallelism", "data_parallel_replicate_degree", p.dp,
                f"zero {p.zero}: DDP over the dp{p.dp} replicas" if p.dp > 1 else "one replica per group"),
            key("parallelism", "data_parallel_shard_degree", 1, "no FSDP"),
        ]
    out += [
        key("parallelism", "tensor_parallel_degree", p.tp, f"every stage's configuration is {layout.config}"),
        key("parallelism", "context_parallel_degree", p.cp,
            f"{layout.config}: each sequence split over {p.cp} ranks (torchtitan shards FSDP over dp x cp)"
            if p.cp > 1 else "no context parallelism"),
        key("parallelism", "expert_parallel_degree", p.ep,
            f"{layout.config}: the experts spread over each group" if p.ep > 1 else "no expert parallelism"),
    ]
    if p.ep > 1:
        out.append(key("parallelism", "expert_tensor_parallel_degree", 1, "an expert is not split tensor-parallel"))
    out.append(key("parallelism", "pipeline_parallel_degree", p.pp,
                   f"{plural(p.pp, 'device group')} of {plural(layout.devices // p.pp, 'device')}"))
    if pipelined:
        out += [
            key("parallelism", "pipeline_parallel_schedule", schedule,
                f"places the stages as the plan does ({layout.placement}); the order is the CSV's" if csv
                else f"the plan's method, {layout.method}"),
            key("parallelism", "pipeline_parallel_microbatch_size", layout.micro_batch_size,
                f"a microbatch of {plural(samples, 'sample')} split dp{p.dp} ways"),
            key("parallelism", "module_fqns_per_model_part", module_fqns(layout),
                f"the plan's {len(layout.stage_layers)} stages; {layout.layer_stack}.N is layers.N"),
        ]
        if csv:
            out.append(key("parallelism", "pipeline_parallel_schedule_csv", csv, "the plan's own order"))
    out.append(key("activation_checkpoint", "mode", "full" if p.recompute == "full" else "none",
                   f"plan recompute {p.recompute}"))
    return out + precision_keys(layout.dtype)


def precision_keys(dtype: str) -> list[TomlKey]:
    """The keys that run the plan's compute dtype: FSDP's / autocast's parameter dtype, and with FP8 torchao's
    Float8Linear on the model's linear layers (torchtitan's ``quantize.linear.float8`` converter), attention
    left in BF16 as the plan was costed.

    >>> [(k.section, k.key, k.value) for k in precision_keys("fp8")][1]
    ('model', 'converters', ['quantize.linear.float8'])
    """
    mixed = "float32" if dtype == "fp32" else "bfloat16"
    out = [TomlKey("training", "mixed_precision_param", mixed, f"plan dtype {dtype}")]
    if dtype == "fp8":
        out.append(TomlKey("model", "converters", ["quantize.linear.float8"],
                           "plan dtype fp8: the linear layers' GEMMs in FP8 (torchao), attention in BF16"))
    return out


def _schedule(layout: PlanLayout, csv: str | None) -> str:
    """torch's schedule name for the plan: the CSV's placement, or the plan's method's schedule."""
    refuse = TORCHTITAN.cannot_run
    if csv or layout.parallel.pp == 1:
        return PLACEMENT_SCHEDULES[layout.placement]
    name = TORCH_SCHEDULES.get(layout.method)
    if name is None:
        raise refuse(f"its order ({layout.method}) is no torch schedule by name; add --torch-csv FILE.csv and the "
                     "TOML names that file (pipeline_parallel_schedule_csv)")
    if _PLACEMENT_OF[name] != layout.placement:
        raise refuse(f"torch's {name} places stages {_PLACEMENT_OF[name]}, the plan {layout.placement}")
    return name


def module_fqns(layout: PlanLayout) -> list[list[str]]:
    """Each stage's modules as torchtitan's decoder models name them: the embedding with the first, the final
    norm and the output layer with the last."""
    out, first = [], 0
    for c, n in enumerate(layout.stage_layers):
        names = [f"layers.{i}" for i in range(first, first + n)]
        if c == 0:
            names.insert(0, "tok_embeddings")
        if c == len(layout.stage_layers) - 1:
            names += ["norm", "output"]
        out.append(names)
        first += n
    return out


def check_with_torch_schedule(layout: PlanLayout, schedule: str) -> None:
    """Build torch's ``schedule`` for the plan's pipeline on stand-in stages, as torchtitan will at start-up, so
    a microbatch count torch refuses is refused here (skipped when torch is missing)."""
    from opsched.export.torch_csv import _mock_stages, torch_available

    if layout.parallel.pp == 1 or not torch_available():
        return
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    cls = get_schedule_class(schedule)
    stages = _mock_stages(len(layout.stage_layers), layout.parallel.pp, layout.parallel.vpp)
    try:
        cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, n_microbatches=layout.microbatches)
    except (ValueError, AssertionError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise TORCHTITAN.cannot_run(f"torch's {schedule} refuses it: {first}") from None


def toml_value(value: TomlValue) -> str:
    """A value in TOML: numbers and booleans bare, strings quoted (JSON's escapes are TOML's), lists of them.

    >>> toml_value(4), toml_value(True), toml_value('a "b"'), toml_value([["x", "y"], ["z"]])
    ('4', 'true', '"a \\\\"b\\\\""', '[["x", "y"], ["z"]]')
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    return "[" + ", ".join(toml_value(v) for v in value) + "]"


def torchtitan_text(layout: PlanLayout, keys: list[TomlKey], plan_path: str | os.PathLike) -> str:
    """The TOML file: a header saying what the plan is and how to use the keys, then one section each."""
    buf = io.StringIO()
    buf.write(f"# torchtitan job configuration for the opsched plan {plan_path} (opsched export --torchtitan).\n"
              f"# Layout: {layout.describe()}. Merge these sections into your model's TOML\n"
              "# ([model], [optimizer], ... stay yours); torchtitan 0.1-0.2 read it with --job.config_file,\n"
              "# torchtitan 0.3 takes the same keys as --SECTION.KEY VALUE overrides.\n")
    for section in dict.fromkeys(k.section for k in keys):
        buf.write(f"\n[{section}]\n")
        for k in (k for k in keys if k.section == section):
            if isinstance(k.value, list):  # one stage a line
                buf.write(f"# {k.source}\n{k.key} = [\n")
                buf.writelines(f"  {toml_value(v)},\n" for v in k.value)
                buf.write("]\n")
            else:
                buf.write(f"{k.key} = {toml_value(k.value)}  # {k.source}\n")
    return buf.getvalue()


@dataclass(frozen=True)
class TorchtitanFile:
    """A plan's torchtitan TOML, every check passed: its layout, its keys, torch's schedule name and its text."""

    layout: PlanLayout
    keys: list[TomlKey]
    schedule: str
    text: str


def torchtitan_file(schedule: Schedule, doc: dict, plan_path: str | os.PathLike, csv: str | None = None,
                    torch_check: bool = True) -> TorchtitanFile:
    """The TOML of the plan ``doc`` (its :class:`Schedule` read by :func:`opsched.export.plan_json.read_plan`),
    or :class:`OpschedError` saying why torchtitan cannot run it; nothing is written.

    ``csv``: the path the TOML names for the plan's own order (None: torch's
    schedule of the plan's method). ``torch_check``: build that schedule with
    torch, when torch is installed (:func:`check_with_torch_schedule`).
    """
    layout = plan_layout(schedule, doc, TORCHTITAN)
    keys = torchtitan_keys(layout, csv)
    name = _schedule(layout, csv)
    if torch_check and not csv:
        check_with_torch_schedule(layout, name)
    return TorchtitanFile(layout, keys, name, torchtitan_text(layout, keys, plan_path))
