"""A plan as the settings a training framework takes: degrees, the layer split and the batch (:class:`PlanLayout`).

Megatron-LM (:mod:`opsched.export.megatron`) and torchtitan
(:mod:`opsched.export.torchtitan`) read a plan the same way, so what they
share is read here once, and a plan neither can run is refused here with the
reason (their own limits stay in their modules). From plan.json:

* the StageGraph: a chain of stages, each running every microbatch
  (:func:`opsched.export.torch_csv.check_expressible`, the rule torch's
  runtime has too), on ``pp`` device groups of equal size; pipeline rank r is
  group r, devices ``r·k .. r·k + k - 1`` (tp innermost, then cp, then dp,
  pp outermost: :class:`opsched.plan.layouts.ParallelLayout`'s rank order); stage c
  sits on rank ``c mod pp`` (a chain, or interleaved with ``vpp = stages /
  pp``) or in a V (two stages per rank, Zero Bubble V / DualPipeV), read
  with :class:`opsched.upper.layouts.Layout`;
* ``stage_contents``: every stage's ``config`` (``tp2.dp2``, ``dp4+ep``,
  ``tp2.cp2.dp2`` with context parallelism;
  :func:`opsched.upper.stages.stage_config`) must be one and the same: the
  frameworks set one tensor / context / data / expert split for the whole model; each
  stage's numbered layers (``model.layers.N``) give the layer split, whole
  layers in model order, the modules outside the layer stack (embedding,
  final norm, head) on the first and the last stage;
* ``optimizer_state``: the precision of Adam's state (fp32 when the plan
  does not say, as before opsched recorded it);
* ``tp_comm_overlap``: the tensor-parallel collectives were costed as
  running under their GEMMs (Megatron's ``--tp-comm-overlap``; false when
  the plan does not say);
* ``dtype``: the compute precision the plan was costed in (bf16 when the
  plan does not say);
* ``recompute_modules``: Megatron's modules (``--recompute-modules``)
  whose forward the plan was costed as running again (none when the plan
  does not say);
* ``attention``: the attention kernel the plan was costed with, ``fused``
  (when the plan does not say) or ``unfused``;
* ``microbatch_size``, ``microbatches``, ``zero``, ``recompute`` and
  ``dims.seq``: a ``dpN`` stage gives each of its N replicas ``1/N`` of a
  microbatch's samples, so a framework's per-rank micro-batch size is
  ``microbatch_size / N``, refused when that is not a whole number; with
  ``cpC`` the sequence must split into ``2·C`` equal chunks (Megatron and
  torchtitan balance causal attention so).

>>> from dataclasses import replace
>>> from opsched.schedule import Schedule, StageGraph, chain_stage_graph
>>> chain = chain_stage_graph(2)        # stage k on devices 2k and 2k+1:
>>> sg = StageGraph([replace(s, devices=(2 * s.id, 2 * s.id + 1)) for s in chain.stages], chain.edges, num_devices=4)
>>> doc = {"microbatch_size": 4, "zero": 1, "recompute": "none", "dims": {"batch": 4, "seq": 2048},
...        "stage_contents": {"0": {"modules": ["model.embed_tokens", "model.layers.0"], "config": "tp2"},
...                           "1": {"modules": ["model.layers.1", "model.norm", "lm_head"], "config": "tp2"}}}
>>> lay = plan_layout(Schedule(sg, 8, [], name="1f1b"), doc, Framework("Megatron-LM", "plan a chain"))
>>> lay.parallel
ParallelLayout(tp=2, pp=2, vpp=1, ep=1, etp=0, cp=1, dp=1, sp=True, zero=1, recompute='none', ends_as_layers=False, tp_overlap=False, attention='fused', pipeline_layout='', first_layers=0, last_layers=0, max_nodes=0, recompute_modules='', encoders_first=False)
>>> lay.stage_layers, lay.micro_batch_size, lay.global_batch_size, lay.seq_len
((1, 1), 4, 32, 2048)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping

from opsched.cost.cluster import ATTENTION_MODES, DTYPE_BYTES, OPTIMIZER_STATE_BYTES, RECOMPUTE_MODES, ZERO_LEVELS
from opsched.cost.blocks import Mode
from opsched.errors import OpschedError
from opsched.export.framework import Framework
from opsched.cost.parallel_layout import ParallelLayout
from opsched.export.torch_csv import check_expressible
from opsched.model.coarsen import UNSCOPED
from opsched.model.recompute_modules import RECOMPUTE_MODULES
from opsched.schedule import Schedule, StageGraph
from opsched.units import plural
from opsched.upper.layouts import Layout, parse_config
from opsched.upper.stages import LAYER_COMPONENT, summarize_layers

@dataclass(frozen=True)
class PlanLayout:
    """What a training framework needs to know of a plan (see the module docstring).

    ``parallel`` holds the degrees in Megatron's names with ``dp`` resolved;
    stage c of ``stage_layers`` / ``stage_modules`` is the framework's model
    chunk c, on pipeline rank :meth:`rank_of_stage`.
    """

    parallel: ParallelLayout
    placement: str  # "chain", "interleaved" or "v" (opsched.upper.layouts.PLACEMENTS)
    config: str  # every stage's configuration, e.g. "tp2.dp2+ep"
    layer_stack: str  # module path of the numbered layers without the number, e.g. "model.layers"
    stage_layers: tuple[int, ...]  # layers each stage holds, in stage order
    stage_modules: tuple[tuple[str, ...], ...]  # the plan's module paths each stage holds
    micro_batch_size: int  # samples one data-parallel rank takes per microbatch
    microbatches: int  # per step
    global_batch_size: int  # samples per step
    seq_len: int | None  # the model's seq dim as planned, None when the plan does not say
    method: str  # what made the plan's order: a baseline's name, mip, ...
    devices: int
    optimizer_state: str = "fp32"  # precision of Adam's state (opsched.cost.cluster.OPTIMIZER_STATE_BYTES)
    dtype: str = "bf16"  # compute precision the plan was costed in (opsched.cost.cluster.DTYPE_BYTES)

    @property
    def num_layers(self) -> int:
        return sum(self.stage_layers)

    @property
    def layout(self) -> Layout:
        """The device groups and which one runs each stage, in opsched's own terms."""
        return Layout(self.devices, self.parallel.pp, self.parallel.vpp, self.placement)

    def rank_of_stage(self, stage: int) -> int:
        return self.layout.group_of_slot(stage)

    def describe(self) -> str:
        """The layout in a line, e.g. ``8 devices: pp 2 x (tp2.dp2), 2 stages per rank interleaved``."""
        p = self.parallel
        shape = "" if p.vpp == 1 else f", {p.vpp} stages per rank " + ("in a V" if self.placement == "v" else "interleaved")
        return f"{plural(self.devices, 'device')}: pp {p.pp} x ({self.config}){shape}"


def plan_layout(schedule: Schedule, doc: dict, runtime: Framework) -> PlanLayout:
    """The :class:`PlanLayout` of a plan, or :class:`OpschedError` saying why ``runtime`` cannot run it.

    ``doc`` is the plan.json document (:func:`opsched.export.plan_json.read_plan`).
    """
    refuse = runtime.cannot_run

    sg = schedule.stage_graph
    try:
        check_expressible(sg, schedule.microbatches, runtime)
    except OpschedError as exc:
        raise refuse(str(exc)) from None
    contents = _stage_contents(doc, len(sg.stages), refuse)
    config = _one_config(contents, refuse)
    base, experts = parse_config(config)
    layout = _placement(sg, refuse)
    if base.ep > 1 or base.size != layout.group_size:
        raise refuse(f"the stages' configuration {config} does not cover their groups of "
                     f"{plural(layout.group_size, 'device')}")
    zero, recompute = _training(doc, refuse)
    try:
        parallel = ParallelLayout(
            tp=base.tp, pp=layout.groups, vpp=layout.virtual, ep=base.size if experts else 1,
            etp=1 if experts else 0,  # opsched's expert-parallel mode does not split an expert tensor-parallel
            cp=base.cp, dp=base.dp, sp=base.tp > 1,  # the cost model shards activations tp ways: sequence parallelism
            zero=zero, recompute=recompute, tp_overlap=_tp_comm_overlap(doc, refuse) and base.tp > 1,
            attention=_attention(doc, refuse), recompute_modules="+".join(_recompute_modules(doc, refuse)),
        ).resolved(layout.devices)
    except OpschedError as exc:
        raise refuse(str(exc)) from None
    stack, layers = _layer_split(contents, refuse)
    micro = _micro_batch_size(doc, base.dp, refuse)
    samples = doc["microbatch_size"]
    seq = (doc.get("dims") or {}).get("seq")
    if base.cp > 1 and isinstance(seq, int) and seq % (2 * base.cp):
        raise refuse(f"its sequence of {seq} tokens does not split into 2 x cp = {2 * base.cp} equal chunks "
                     f"(context parallelism balances causal attention so); plan a --seq-len divisible by {2 * base.cp}")
    return PlanLayout(
        parallel=parallel, placement=layout.placement, config=config, layer_stack=stack,
        stage_layers=tuple(layers), stage_modules=tuple(tuple(c["modules"]) for c in contents),
        micro_batch_size=micro, microbatches=schedule.microbatches,
        global_batch_size=samples * schedule.microbatches,
        seq_len=seq if isinstance(seq, int) and not isinstance(seq, bool) and seq > 0 else None,
        method=schedule.name or "unnamed", devices=layout.devices, optimizer_state=_optimizer_state(doc, refuse),
        dtype=_dtype(doc, refuse),
    )


def check_without_context_parallel(doc: dict, runtime: Framework) -> None:
    """Refuse a plan whose stages split sequences over context-parallel ranks (a ``cpC`` config) for ``runtime``,
    which runs the pipeline's order but not context parallelism (torch's pipeline runtime alone).

    >>> doc = {"stage_contents": {"0": {"modules": ["model.layers.0"], "config": "cp2.dp4"}}}
    >>> check_without_context_parallel(doc, Framework("torch.distributed.pipelining", ""))
    Traceback (most recent call last):
    opsched.errors.OpschedError: torch.distributed.pipelining cannot run this plan: its stages split each sequence over 2 context-parallel ranks (cp2.dp4), which it does not do; export it with --torchtitan F.toml --torch-csv F.csv or --megatron F
    """
    for config, base in _configs(doc):
        cp = base.cp
        if cp > 1:
            raise runtime.cannot_run(f"its stages split each sequence over {cp} context-parallel ranks ({config}), "
                                     f"which it does not do; {_context_parallel_export(doc)}")


#: the exports of the runtimes that run context parallelism (``Runtime.context_parallel``), by runtime name
_CONTEXT_PARALLEL_EXPORTS = {"torchtitan": "--torchtitan F.toml --torch-csv F.csv", "megatron": "--megatron F"}


def _context_parallel_export(doc: dict) -> str:
    """Where to turn for a plan with context parallelism: the exports of the runtimes that run it, those of them
    plan.json says can run this plan when it says (``runtimes``; the plan's own verdicts are made without it).

    >>> _context_parallel_export({}), _context_parallel_export({"runtimes": ["megatron"]})
    ('export it with --torchtitan F.toml --torch-csv F.csv or --megatron F', 'export it with --megatron F')
    >>> _context_parallel_export({"runtimes": []})
    'no runtime opsched exports to runs this plan (report.md says why for each); plan with --runtime torchtitan or --runtime megatron for one that does'
    """
    able = doc.get("runtimes")
    flags = [flag for name, flag in _CONTEXT_PARALLEL_EXPORTS.items() if able is None or name in able]
    if flags:
        return "export it with " + " or ".join(flags)
    return ("no runtime opsched exports to runs this plan (report.md says why for each); plan with "
            + " or ".join(f"--runtime {name}" for name in _CONTEXT_PARALLEL_EXPORTS) + " for one that does")


def layer_split(doc: dict, stages: int, runtime: Framework) -> tuple[str, list[int]]:
    """(the layer stack's module path, layers per stage) of a plan with ``stages`` stages, by the rules of
    :func:`plan_layout` (whole layers in model order, the rest at either end) and nothing else of it: for a
    runtime that sets no parallel configuration (``opsched run --hf-config``).

    >>> layer_split({"stage_contents": {"0": {"modules": ["embed", "model.layers.0"], "config": "single"},
    ...                                 "1": {"modules": ["model.layers.1", "model.layers.2", "lm_head"],
    ...                                       "config": "dp2"}}}, 2, Framework("torch", ""))
    ('model.layers', [1, 2])
    """
    refuse = runtime.cannot_run

    return _layer_split(_stage_contents(doc, stages, refuse), refuse)


def _stage_contents(doc: dict, stages: int, refuse) -> list[dict]:
    """Each stage's ``stage_contents`` entry, in stage order; refused when the plan does not say what stages hold."""
    raw = doc.get("stage_contents")
    if not isinstance(raw, dict) or not raw:
        raise refuse("it does not say which layers each stage holds (no stage_contents); make it with `opsched plan`")
    out = []
    for k in range(stages):
        entry = raw.get(str(k))
        if not isinstance(entry, dict) or not isinstance(entry.get("modules"), list) or not entry["modules"]:
            raise refuse(f"stage_contents has no modules for stage {k}; make the plan again with `opsched plan`")
        if "config" not in entry:
            raise refuse("its stage_contents has no config (an older opsched wrote it); make it again with "
                         "`opsched plan`")
        out.append(entry)
    return out


def _one_config(contents: list[dict], refuse) -> str:
    """The configuration every stage shares: one tensor / data / expert split is all a framework sets."""
    for k, entry in enumerate(contents):
        if entry["config"] is None:
            modes = entry.get("modes") or {}
            which = "; ".join(f"{mode}: {layers}" for mode, layers in modes.items())
            raise refuse(f"stage {k} runs its blocks with weights in different parallel modes ({which}); "
                         "a framework sets one tensor / data-parallel split for every layer")
    configs = {entry["config"] for entry in contents}
    if len(configs) > 1:
        per_stage = ", ".join(f"stage {k}: {entry['config']}" for k, entry in enumerate(contents))
        raise refuse(f"its stages use different parallel configurations ({per_stage}); "
                     "a framework sets one for the whole model")
    config = configs.pop()
    try:
        parse_config(config)
    except OpschedError as exc:
        raise refuse(f"stage_contents config {exc}") from None
    return config


def _placement(sg: StageGraph, refuse) -> Layout:
    """The :class:`Layout` whose groups and slot order the stages follow exactly (chain, interleaved or V)."""
    groups = sorted({tuple(sorted(s.devices)) for s in sg.stages}, key=min)
    sizes = {len(g) for g in groups}
    if len(sizes) > 1:
        raise refuse(f"its device groups differ in size ({', '.join(map(str, sorted(sizes)))} devices); "
                     "every pipeline rank of a framework has the same tensor x data-parallel shape")
    size = sizes.pop()
    devices = sg.num_devices or len(groups) * size
    stages = len(sg.stages)
    if devices != len(groups) * size or stages % len(groups):
        raise refuse(f"its {plural(stages, 'stage')} on {plural(len(groups), 'device group')} do not use "
                     f"every one of the {plural(devices, 'device')} the same number of times")
    virtual = stages // len(groups)
    candidates = ["chain"] if virtual == 1 else ["interleaved", "v"] if virtual == 2 else ["interleaved"]
    for placement in candidates:
        layout = Layout(devices, len(groups), virtual, placement)
        if all(tuple(sorted(s.devices)) == layout.devices_of_group(layout.group_of_slot(s.id)) for s in sg.stages):
            return layout
    where = ", ".join(f"stage {s.id} on devices {list(s.devices)}" for s in sg.stages)
    raise refuse(f"its stages sit neither in a chain, interleaved nor in a V over the device groups in order "
                 f"({where}); pipeline rank r of a framework is devices r·k..r·k+k-1")


def _training(doc: dict, refuse) -> tuple[int, str]:
    """(ZeRO level, recomputation) the plan was costed with; a plan from before they were recorded had neither."""
    zero = doc.get("zero", 0)
    recompute = doc.get("recompute", "none")
    if isinstance(zero, bool) or zero not in ZERO_LEVELS:
        raise refuse(f"field zero is {zero!r}; one of {', '.join(map(str, ZERO_LEVELS))}")
    if recompute not in RECOMPUTE_MODES:
        raise refuse(f"field recompute is {recompute!r}; one of {', '.join(RECOMPUTE_MODES)}")
    return zero, recompute


def _optimizer_state(doc: dict, refuse) -> str:
    """The precision of Adam's state the plan was costed with; a plan from before it was recorded had FP32."""
    state = doc.get("optimizer_state", "fp32")
    if state not in OPTIMIZER_STATE_BYTES:
        raise refuse(f"field optimizer_state is {state!r}; one of {', '.join(OPTIMIZER_STATE_BYTES)}")
    return state


def _dtype(doc: Mapping, refuse) -> str:
    """The compute precision the plan was costed in; a plan from before it was recorded was costed in BF16."""
    dtype = doc.get("dtype", "bf16")
    if dtype not in DTYPE_BYTES:
        raise refuse(f"field dtype is {dtype!r}; one of {', '.join(DTYPE_BYTES)}")
    return dtype


def _tp_comm_overlap(doc: Mapping, refuse) -> bool:
    """Whether the plan was costed with its tensor-parallel collectives under their GEMMs; a plan from before it
    was recorded was not."""
    overlap = doc.get("tp_comm_overlap", False)
    if not isinstance(overlap, bool):
        raise refuse(f"field tp_comm_overlap is {overlap!r}; true or false")
    return overlap


def _recompute_modules(doc: Mapping, refuse) -> list[str]:
    """Megatron's modules the plan recomputes (``recompute_modules``); none when the plan does not say."""
    modules = doc.get("recompute_modules", [])
    if not isinstance(modules, list) or not all(m in RECOMPUTE_MODULES for m in modules):
        raise refuse(f"field recompute_modules is {modules!r}; a list of {', '.join(RECOMPUTE_MODULES)}")
    return modules


def _attention(doc: Mapping, refuse) -> str:
    """The attention kernel the plan was costed with; a plan from before it was recorded ran it fused."""
    attention = doc.get("attention", "fused")
    if attention not in ATTENTION_MODES:
        raise refuse(f"field attention is {attention!r}; one of {', '.join(ATTENTION_MODES)}")
    return attention


def check_torch_can_run(doc: Mapping, runtime: Framework, copies: Collection[int] = ()) -> None:
    """Refuse a plan that torch's pipeline runtime alone cannot run as costed: stages that split sequences over
    context-parallel ranks (:func:`check_without_context_parallel`), layers split between stages
    (:func:`check_whole_layers`; ``copies``: the ids of stages that copy another, DualPipe's), or tensor-parallel
    collectives costed as
    overlapped with their GEMMs.

    >>> doc = {"tp_comm_overlap": True, "stage_contents": {"0": {"modules": ["model.layers.0"], "config": "tp2.dp4"}}}
    >>> check_torch_can_run(doc, Framework("torch.distributed.pipelining", ""))
    Traceback (most recent call last):
    opsched.errors.OpschedError: torch.distributed.pipelining cannot run this plan: its tensor-parallel collectives (tp2.dp4) are costed as running under their GEMMs (Megatron's --tp-comm-overlap), which it does not do; export it with --megatron F, or plan with --tp-comm-overlap off
    """
    check_without_context_parallel(doc, runtime)
    check_whole_layers(doc, runtime, copies)
    if doc.get("tp_comm_overlap") is not True:
        return
    for config, base in _configs(doc):
        if base.tp > 1:
            raise runtime.cannot_run(f"its tensor-parallel collectives ({config}) are costed as running under their "
                                     "GEMMs (Megatron's --tp-comm-overlap), which it does not do; export it with "
                                     "--megatron F, or plan with --tp-comm-overlap off")


def check_whole_layers(doc: Mapping, runtime: Framework, copies: Collection[int] = ()) -> None:
    """Refuse a plan whose ``stage_contents`` split a numbered layer between stages, or hold a stack's layers out
    of model order (:func:`stack_splits`'s rules): torch's runtime builds each stage from whole layers
    (``opsched run --hf-config`` runs a model's own layer modules). A plan that does not say what its stages hold
    (no ``stage_contents``: a `compare` schedule) has no layers to split; a stage in ``copies`` holds what the
    stage it copies holds (DualPipe's second direction), which the schedule's own checks speak of.

    >>> doc = {"stage_contents": {"0": {"modules": ["model.layers.0", "model.layers.1"]},
    ...                           "1": {"modules": ["model.layers.1", "lm_head"]}}}
    >>> check_whole_layers(doc, Framework("torch.distributed.pipelining", ""))
    Traceback (most recent call last):
    opsched.errors.OpschedError: torch.distributed.pipelining cannot run this plan: layer model.layers.1 is split between stages 0 and 1; its runtime builds each stage from whole layers (as `opsched run --hf-config` does); plan with --runtime torch, which keeps layers whole
    """
    raw = doc.get("stage_contents")
    if not isinstance(raw, dict):
        return
    entries = [raw[k] for k in sorted(raw, key=lambda k: int(k) if str(k).isdigit() else -1)
               if not (str(k).isdigit() and int(k) in copies)]
    contents = [{"modules": [m for m in e.get("modules", []) if isinstance(m, str)]} for e in entries
                if isinstance(e, dict) and isinstance(e.get("modules"), list)]

    def refuse(reason: str) -> OpschedError:
        reason = reason.replace("a framework puts whole layers on a pipeline stage",
                                "its runtime builds each stage from whole layers (as `opsched run --hf-config` does); "
                                "plan with --runtime torch, which keeps layers whole")
        return runtime.cannot_run(reason)

    if len(contents) == len(entries):
        _stack_splits(contents, refuse)


def _configs(doc: Mapping) -> list[tuple[str, Mode]]:
    """(name, base mode) of each distinct stage configuration of plan.json's ``stage_contents`` that the notation
    reads (:func:`opsched.upper.layouts.parse_config`)."""
    raw = doc.get("stage_contents")
    entries = raw.values() if isinstance(raw, dict) else []
    out = []
    for config in dict.fromkeys(e.get("config") for e in entries if isinstance(e, dict)):
        if not isinstance(config, str):
            continue
        try:
            out.append((config, parse_config(config)[0]))
        except OpschedError:
            continue  # a name the notation does not cover says nothing; the frameworks refuse it themselves
    return out


def _layer_split(contents: list[dict], refuse) -> tuple[str, list[int]]:
    """(the layer stack's module path, layers per stage): whole layers in model order, the rest at either end."""
    per_stack = _stack_splits(contents, refuse)
    for k, entry in enumerate(contents):
        _check_ends(entry["modules"], k, len(contents) - 1, refuse)
    stack = one_layer_stack(per_stack, refuse)
    return stack, [len(indices) for indices in per_stack[stack]]


def stack_splits(doc: dict, stages: int, runtime: Framework) -> dict[str, list[list[int]]]:
    """Every stack of numbered layers in a plan (in model order) -> the layer numbers each stage holds of it:
    whole layers, each stack's in model order along the stages and none missing (the rules of
    :func:`plan_layout` for one stack, here for each). For a runtime that runs two stacks side by side
    (``opsched run --hf-config`` on CLIP's towers).

    >>> stack_splits({"stage_contents": {"0": {"modules": ["vision.layers.0", "vision.layers.1"], "config": "single"},
    ...                                  "1": {"modules": ["text.layers.0", "head"], "config": "single"}}},
    ...              2, Framework("torch", ""))
    {'vision.layers': [[0, 1], []], 'text.layers': [[], [0]]}
    """
    refuse = runtime.cannot_run

    return _stack_splits(_stage_contents(doc, stages, refuse), refuse)


def _stack_splits(contents: list[dict], refuse) -> dict[str, list[list[int]]]:
    """:func:`stack_splits` of the stage_contents entries ``contents``; ``refuse(reason)`` raised when a layer is
    split between stages, a stack's layers run out of model order or some layer is on no stage."""
    per_stack: dict[str, list[list[int]]] = {}
    owner: dict[tuple[str, int], int] = {}  # layer -> the stage holding it
    for k, entry in enumerate(contents):
        for path in entry["modules"]:
            layer = _layer_number(path)
            if layer is None:
                continue
            if layer in owner and owner[layer] != k:
                raise refuse(f"layer {layer[0]}.{layer[1]} is split between stages {owner[layer]} and {k}; "
                             "a framework puts whole layers on a pipeline stage")
            owner[layer] = k
            per_stack.setdefault(layer[0], [[] for _ in contents])[k].append(layer[1])
    for stack, per_stage in per_stack.items():
        done = -1  # the last layer of the stages before
        for k, indices in enumerate(per_stage):
            if indices and (indices != sorted(indices) or indices[0] < done):
                held = summarize_layers([f"{stack}.{i}" for i in indices])
                raise refuse(f"stage {k} holds {held}, out of model order; a framework's stage c holds the layers "
                             "that follow stage c-1's")
            done = indices[-1] if indices else done
        flat = sorted(i for indices in per_stage for i in indices)
        if flat != list(range(len(flat))):
            missing = sorted(set(range(flat[-1] + 1)) - set(flat))
            raise refuse(f"no stage holds {summarize_layers([f'{stack}.{i}' for i in missing])}")
    return per_stack


def one_layer_stack(stacks, refuse) -> str:
    """The one stack of numbered layers a framework's pipeline splits, from the stacks a model's modules belong
    to in model order (``stacks``), or ``refuse(reason)`` raised: none, or two (a vision tower and a language
    model). ``opsched plan --runtime`` asks it before the search, with the model's own layers.

    >>> one_layer_stack(["model.layers"], OpschedError)
    'model.layers'
    >>> one_layer_stack(["vision.layers", "model.layers"], OpschedError)
    Traceback (most recent call last):
    opsched.errors.OpschedError: the model has 2 stacks of numbered layers (vision.layers, model.layers); a framework's pipeline splits one decoder stack
    """
    stacks = list(dict.fromkeys(stacks))
    if not stacks:
        raise refuse("its stages hold no numbered layers (model.layers.N, h.N, ...) to split into pipeline stages")
    if len(stacks) > 1:
        raise refuse(f"the model has {len(stacks)} stacks of numbered layers ({', '.join(stacks)}); "
                     "a framework's pipeline splits one decoder stack")
    return stacks[0]


def layer_stack_of(path: str) -> str | None:
    """The stack a module path's numbered layer belongs to (``model.layers.3`` -> ``model.layers``), else None.

    >>> layer_stack_of("model.layers.3"), layer_stack_of("lm_head")
    ('model.layers', None)
    """
    layer = _layer_number(path)
    return None if layer is None else layer[0]


def _check_ends(modules: list[str], k: int, last: int, refuse) -> None:
    """Modules outside the layer stack (embedding, final norm, head) only before the first stage's layers or
    after the last stage's: a framework builds them on the first and the last pipeline stage. Operators the
    exporter left without a module (:data:`opsched.model.coarsen.UNSCOPED`) are in no module to place: they run
    inside whichever module computes them (DeepSeek-V3's attention, exported in part without a scope)."""
    numbered = [i for i, path in enumerate(modules) if _layer_number(path) is not None]
    for i, path in enumerate(modules):
        if i in numbered or path == UNSCOPED:
            continue
        before = not numbered or i < numbered[0]
        after = not numbered or i > numbered[-1]
        if not ((k == 0 and before) or (k == last and after)):
            raise refuse(f"stage {k} holds {path} beside its layers; a framework puts what lies outside the "
                         "layer stack on the first stage (before the layers) or the last (after them)")


def _layer_number(path: str) -> tuple[str, int] | None:
    """(stack, index) of a numbered layer's module path (``model.layers.3`` -> ``("model.layers", 3)``), else None.

    >>> _layer_number("model.layers.3"), _layer_number("transformer.h.11"), _layer_number("lm_head")
    (('model.layers', 3), ('transformer.h', 11), None)
    """
    parts = path.split(".")
    if len(parts) < 2 or not LAYER_COMPONENT.match(".".join(parts[-2:])):
        return None
    return ".".join(parts[:-1]), int(parts[-1])


def _micro_batch_size(doc: dict, dp: int, refuse) -> int:
    """Samples one data-parallel rank takes per microbatch: the plan's microbatch split dp ways, whole."""
    samples = doc.get("microbatch_size")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise refuse("it has no microbatch_size (samples per microbatch); make it with `opsched plan`")
    if samples % dp:
        raise refuse(f"its dp{dp} stages split each microbatch of {plural(samples, 'sample')} {dp} ways, "
                     f"{samples}/{dp} samples per replica; plan with a batch dim divisible by {dp} "
                     f"(`opsched plan --dim batch={dp * -(-samples // dp)}`)")
    return samples // dp
