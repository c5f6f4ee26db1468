"""Predict the step time of a layout a user runs today (Megatron-style tp / pp / vpp / ep / dp).

``opsched evaluate`` answers "what does opsched think of the configuration I
run?" with the same cost model (:mod:`opsched.cost.blocks`), simulator and
hand-written schedules (:mod:`opsched.baselines`) the planner uses, so a
plan and a user's layout are compared like with like.

A layout is Megatron's: ``tp`` tensor-parallel ranks innermost, then ``dp``
data-parallel replicas, ``pp`` pipeline ranks outermost (device
``r·N/pp + j·tp + t`` is tensor rank t of replica j on pipeline rank r).
The model's layers are split evenly into ``pp × vpp`` chunks; chunk c runs
on pipeline rank ``c mod pp`` (interleaved when ``vpp > 1``); blocks before
the first layer (embedding) join the first chunk, blocks after the last
(final norm, head) the last. With ``ends_as_layers=1`` the embedding and the
head count as one layer each in that split, so the first and last chunks
hold one layer fewer (Megatron-Core's ``--account-for-embedding-in-pipeline-split``
and ``--account-for-loss-in-pipeline-split``; DeepSpeed's partition method
``type:transformer|embedding``, as BLOOM-176B ran: 70 layers + 2 over 12 stages). Expert parallelism is folded over the data
parallel replicas: ``ep`` replicas of a pipeline rank share its experts,
each holding ``experts / ep`` of every MoE layer and exchanging routed
tokens by all-to-all. The rules and their sources are in
``docs/cost-model.md`` (section "Evaluating a layout").

>>> ParallelLayout.parse("tp=2,pp=4,vpp=2,zero=1,recompute=full")
ParallelLayout(tp=2, pp=4, vpp=2, ep=1, etp=0, cp=1, dp=0, sp=False, zero=1, recompute='full', ends_as_layers=False, tp_overlap=False, attention='fused', pipeline_layout='', first_layers=0, last_layers=0, max_nodes=0, recompute_modules='', encoders_first=False)
>>> ParallelLayout.parse("tp=2,pp=4").resolved(16).dp
2
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import networkx as nx

from opsched.baselines import baseline_order, placed_stage_graph, run_baseline
from opsched.baselines import method as baseline_module
from opsched.cost.cluster import Cluster, Training
from opsched.cost.blocks import expert_count
from opsched.errors import OpschedError, Unsupported
from opsched.model.graph import COST_FIELDS, Block, common_heads
from opsched.cost.parallel_layout import ParallelLayout
from opsched.lower.jobs import order_peak_activation
from opsched.plan.chunk_cost import _block_held_bytes, _chunk_cost, _cluster_key, _rank_devices, chunk_classes
from opsched.plan.phases import StepPhases, step_phases
from opsched.schedule import Edge, Schedule, Stage, StageGraph, device_param_bytes, metrics
from opsched.upper.stages import LAYER_COMPONENT, layer_path

log = logging.getLogger(__name__)




@dataclass
class Evaluation:
    """The predicted step of one layout (``opsched evaluate``); times in seconds, memory in bytes per device."""

    layout: ParallelLayout
    schedule_name: str
    microbatches: int  # per pipeline, per step
    global_batch: int  # sequences per step
    tokens_per_step: int
    step_time: float
    tokens_per_second_per_device: float
    mfu: float
    model_flops_per_step: float
    peak_memory_bytes: float
    memory_limit: float
    breakdown: dict[str, float]
    schedule: Schedule
    #: the largest rank's whole gradient sync, not overlapped (what the planner adds to a makespan)
    grad_sync: float = 0.0
    #: chunk (stage) id -> its blocks, in model order
    chunks: list[list[int]] = dataclasses.field(default_factory=list)
    #: the busiest rank's step split as DeepSeek reports DualPipe's (None: not timed)
    phases: StepPhases | None = None

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_limit

    def to_dict(self) -> dict:
        return {
            # etp 0 means "as tp" (ParallelLayout): said as the degree costed, as dp is said resolved
            "layout": {**dataclasses.asdict(self.layout), "etp": self.layout.etp or self.layout.tp},
            "schedule": self.schedule_name,
            "microbatches": self.microbatches,
            "global_batch": self.global_batch,
            "tokens_per_step": self.tokens_per_step,
            "step_time": self.step_time,
            "tokens_per_second_per_device": self.tokens_per_second_per_device,
            "mfu": self.mfu,
            "model_flops_per_step": self.model_flops_per_step,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_limit_bytes": self.memory_limit,
            "fits": self.fits,
            "breakdown": self.breakdown,
            # the planner's accounting of the same step: makespan + the whole gradient sync, no optimizer step
            "makespan": self.schedule.makespan,
            "grad_sync_seconds": self.grad_sync,
            "phases": self.phases._asdict() if self.phases else None,
        }

    @property
    def planner_step(self) -> float:
        """The step as ``opsched plan`` counts every candidate's: the makespan plus the whole gradient sync (none of
        it hidden under the last backward), no optimizer step; like with like across its candidates."""
        return self.schedule.step_time(self.grad_sync)


@dataclass
class ModelIndex:
    """What evaluating any layout of one BlockGraph needs from it, computed once (:func:`model_index`)."""

    order: list[int]  # blocks in topological order
    layer_of: dict[int, str | None]  # block -> its numbered layer's module path (None: outside every layer)
    layers: list[str]  # numbered decoder layers in model order (MTP layers apart)
    experts_of: dict[int, int]  # block -> experts it holds
    experts: int  # experts of one MoE layer (0: dense)
    #: block -> the share of its MoE layer's experts it holds (0: no expert). A layer's dispatch and combine are
    #: one all-to-all each, whatever blocks its experts were exported as, so a block carries this share of the
    #: collective's latency (and its own tokens' bytes)
    expert_share: dict[int, float]
    tokens_in: dict[int, float]  # block -> its largest input edge (bytes)
    forward_flops: float
    #: block -> its class of blocks alike in everything a block's cost reads (its cost fields, input size and
    #: whether it holds experts): every layer of a uniform model, every expert of a layer
    cost_class: dict[int, int] = dataclasses.field(default_factory=dict)
    #: per setting of a layout's terms, one device's share of a block (:func:`_block_share`) by its cost class
    block_shares: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    #: numbered layers of a multi-token-prediction module (a path with an ``mtp`` component: Megatron-Core's
    #: ``mtp.layers.N``), in model order; the pipeline split places them apart from the decoder layers (``m``)
    mtp_layers: list[str] = dataclasses.field(default_factory=list)
    #: block holding experts -> copies of each token its MoE layer routes (top-k times the capacity factor): the
    #: layer's expert inputs over its input, the residual stream (what node-limited routing sends once a node)
    routed_copies: dict[int, float] = dataclasses.field(default_factory=dict)
    #: what a layout's tensor-parallel degree must divide: every attention's heads (:func:`common_heads`; 0: none known)
    heads: int = 0


def model_index(bg: nx.DiGraph) -> ModelIndex:
    """The :class:`ModelIndex` of ``bg``: its numbered layers in model order, experts per MoE layer, ...

    >>> bg = nx.DiGraph(kind="BlockGraph")
    >>> for i, name in enumerate(["embed", "model/layers.0/attn", "model/layers.0/mlp", "model/layers.1", "head"]):
    ...     bg.add_node(i, block=Block(i, name, (), ()))
    >>> nx.add_path(bg, range(5))
    >>> model_index(bg).layers
    ['model.layers.0', 'model.layers.1']
    """
    order = list(nx.lexicographical_topological_sort(bg))
    layer_of: dict[int, str | None] = {}
    layers: dict[str, None] = {}
    per_layer: dict[str, int] = {}
    experts_of = {}
    expert_layer: dict[int, str] = {}  # block holding experts -> its layer's path
    for b in order:
        block: Block = bg.nodes[b]["block"]
        path = layer_path(block.name)
        numbered = bool(LAYER_COMPONENT.match(".".join(path.split(".")[-2:])))
        layer_of[b] = path if numbered else None
        if numbered:
            layers.setdefault(path, None)
        experts_of[b] = expert_count(block)
        if experts_of[b]:
            expert_layer[b] = path
            per_layer[path] = per_layer.get(path, 0) + experts_of[b]
    expert_share = {b: experts_of[b] / per_layer[expert_layer[b]] if experts_of[b] else 0.0 for b in order}
    tokens_in = {b: max((d.get("bytes", 0.0) for _, _, d in bg.in_edges(b, data=True)), default=0.0) for b in order}
    classes: dict[tuple, int] = {}
    cost_class = {b: classes.setdefault((tuple(getattr(bg.nodes[b]["block"], f) for f in COST_FIELDS), tokens_in[b],
                                         expert_share[b]), len(classes)) for b in order}
    mtp = [path for path in layers if is_mtp_path(path)]
    return ModelIndex(order, layer_of, [path for path in layers if not is_mtp_path(path)], experts_of,
                      max(per_layer.values(), default=0), expert_share, tokens_in,
                      sum(bg.nodes[b]["block"].flops for b in order), cost_class, mtp_layers=mtp,
                      routed_copies=_routed_copies(order, layer_of, expert_layer, tokens_in),
                      heads=common_heads([bg.nodes[b]["block"] for b in order]))


def _routed_copies(order: list[int], layer_of: dict[int, str | None], expert_layer: dict[int, str],
                   tokens_in: dict[int, float]) -> dict[int, float]:
    """Block holding experts -> its layer's expert input bytes over the layer's first block's input (the residual
    stream entering the layer): the copies of each token the router sends (top-k x capacity factor)."""
    entering: dict[str, float] = {}
    routed: dict[str, float] = {}
    for b in order:
        path = layer_of[b]
        if path is not None and b not in expert_layer:
            entering.setdefault(path, tokens_in[b])
    for b, path in expert_layer.items():
        routed[path] = routed.get(path, 0.0) + tokens_in[b]
    return {b: routed[path] / entering[path] if entering.get(path) else 1.0 for b, path in expert_layer.items()}


def is_mtp_path(path: str) -> bool:
    """Whether a module path lies in a multi-token-prediction module (a component named ``mtp``).

    >>> is_mtp_path("model.mtp.layers.0"), is_mtp_path("model.layers.3")
    (True, False)
    """
    return "mtp" in path.split(".")


def layer_chunks(bg: nx.DiGraph, chunks: int, index: ModelIndex | None = None,
                 ends_as_layers: bool = False, units: tuple[str, ...] | None = None,
                 encoders_first: bool = False) -> list[list[int]]:
    """Blocks of each of ``chunks`` chunks: the layers split evenly in model order, the rest at either end.

    ``units``: the chunks' units as :func:`opsched.cost.pipeline_split.chunk_units` gives them (an uneven
    split); default the even split (with ``ends_as_layers``, the embedding and head count as one layer each).
    Decoder layers (``t``) and MTP layers (``m``) fill the chunks in model order. Blocks outside every numbered
    layer join the chunk of the embedding (``E``) when they come before the first layer in topological order,
    the chunk of the first MTP layer when they lie in the MTP module, else the chunk of the loss (``L``). With
    ``encoders_first`` only the last stack of layers is split, the other stacks join the first chunk whole
    (:func:`split_layers`; Megatron-Core's multimodal layout, the encoder in the first pipeline stage).
    """
    index = index or model_index(bg)
    layers, _ = split_layers(index, encoders_first)
    if not layers:
        raise OpschedError(f"the model has no numbered layers to split into {chunks} chunks")
    if units is None:
        units = ParallelLayout(pp=chunks, ends_as_layers=ends_as_layers).chunk_units(len(layers),
                                                                                    len(index.mtp_layers))
    if len(units) != chunks:
        raise OpschedError(f"{len(units)} chunks of units for {chunks} chunks")
    owner = [c for c, chunk in enumerate(units) for _ in chunk]  # chunk of each unit, E first and L last
    out: list[list[int]] = [[] for _ in range(chunks)]
    for b, unit in block_units(bg, index, encoders_first).items():
        out[owner[unit]].append(b)
    return out


def block_units(bg: nx.DiGraph, index: ModelIndex, encoders_first: bool = False) -> dict[int, int]:
    """Each block's unit of a layout string, in topological order: its position in ``E``, the split layers
    (``t``), the MTP layers (``m``), ``L`` (the one home of where a block outside every layer goes, for
    :func:`layer_chunks` and the layout search's work per unit). Blocks outside every numbered layer go with
    the embedding (``E``) when they come before the first split layer, with the first MTP layer when they lie in
    the MTP module, with the loss (``L``) after the last split layer, and between layers with the latest unit
    that feeds them (an encoder's final norm and projection join the layers they follow, so every chunk only
    feeds later ones, as the model's data flows). With ``encoders_first`` the encoders' layers are the
    embedding's (:func:`split_layers`)."""
    layers, encoders = split_layers(index, encoders_first)
    position = {name: 1 + i for i, name in enumerate(layers)}
    position.update((name, 1 + len(layers) + i) for i, name in enumerate(index.mtp_layers))
    position.update((name, 0) for name in encoders)
    loss = 1 + len(layers) + len(index.mtp_layers)
    mtp_unit = 1 + len(layers) if index.mtp_layers else loss
    split = set(layers)
    # the last block of the stack that is split (the language model's last layer): what follows it is the head's
    last = max((i for i, b in enumerate(index.order) if index.layer_of[b] in split), default=-1)
    unit_of: dict[int, int] = {}
    started = False
    for i, b in enumerate(index.order):
        path = index.layer_of[b]
        if path is not None:
            started = started or path not in encoders
            unit_of[b] = position[path]
        elif is_mtp_path(layer_path(bg.nodes[b]["block"].name)):
            unit_of[b] = mtp_unit
        elif not started or i > last:
            unit_of[b] = loss if started else 0
        else:
            unit_of[b] = max((unit_of[a] for a in bg.predecessors(b) if a in unit_of), default=0)
    return unit_of


def split_layers(index: ModelIndex, encoders_first: bool) -> tuple[list[str], list[str]]:
    """(the layers split evenly into chunks, the layers the first chunk holds whole): every numbered layer and
    none; with ``encoders_first``, the layers of the stack of the last layer (module path without the layer
    number: the language model, which the encoders feed) and those of the other stacks (the encoders).

    >>> idx = ModelIndex([], {}, ["vit.layers.0", "vit.layers.1", "lm.layers.0", "lm.layers.1", "lm.layers.2"],
    ...                  {}, 0, {}, {}, 0.0)
    >>> split_layers(idx, True)
    (['lm.layers.0', 'lm.layers.1', 'lm.layers.2'], ['vit.layers.0', 'vit.layers.1'])
    """
    if not encoders_first:
        return list(index.layers), []
    stacks: dict[str, list[str]] = {}
    for name in index.layers:
        stacks.setdefault(name.rsplit(".", 1)[0], []).append(name)
    main = stacks[index.layers[-1].rsplit(".", 1)[0]]
    if len(stacks) == 1:  # nothing to put first: said, not ignored (the layout line would claim "encoders-first")
        raise OpschedError(f"encoders_first=1 puts every stack of layers but the last whole into the first pipeline "
                           f"chunk, but the model has one stack ({next(iter(stacks))}: {len(main)} layers); "
                           "leave encoders_first out")
    return main, [name for name in index.layers if name not in set(main)]


def evaluate_layout(
    bg: nx.DiGraph,
    cluster: Cluster,
    training: Training,
    layout: ParallelLayout,
    *,
    global_batch: int,
    micro_batch_size: int,
    tokens_per_sequence: int,
    schedule: str | None = None,
    memory_limit: float | None = None,
    index: ModelIndex | None = None,
    memory_first: bool = False,
) -> Evaluation:
    """Predict the training step of ``layout`` (see the module docstring).

    ``bg``'s costs are for one microbatch of ``micro_batch_size`` sequences
    (the import's dims). Microbatches per pipeline = global batch / (dp x
    micro-batch size). ``schedule`` is a baseline name (default:
    ``interleaved-1f1b`` when vpp > 1, else ``1f1b``). ``index``: ``bg``'s
    :func:`model_index`, when the caller evaluates many layouts. With
    ``memory_first``, a layout whose schedule overflows the memory limit is
    not timed: its peak comes from the schedule's order alone (a rank's order
    fixes its peak, :func:`opsched.lower.jobs.order_peak_activation`), and
    the evaluation has no events and an infinite step time.
    """
    index = index or model_index(bg)
    layout = layout.resolved(cluster.devices)
    layout.check_model(len(split_layers(index, layout.encoders_first)[0]), index.experts, len(index.mtp_layers),
                       index.heads)
    if layout.cp > 1 and tokens_per_sequence % (2 * layout.cp):  # as layout_search.context_degrees and the exports
        raise OpschedError(f"cp={layout.cp}: a sequence of {tokens_per_sequence} tokens does not split into 2 x cp = "
                           f"{2 * layout.cp} equal chunks (Megatron and torchtitan split it so to balance causal "
                           f"attention); use a --seq-len divisible by {2 * layout.cp}, or another cp")
    if global_batch % (layout.dp * micro_batch_size):
        raise OpschedError(f"global batch {global_batch} is not a multiple of dp x micro-batch size = "
                           f"{layout.dp} x {micro_batch_size}")
    M = global_batch // (layout.dp * micro_batch_size)
    name = schedule or ("interleaved-1f1b" if layout.vpp > 1 else "1f1b")
    limit = float(cluster.memory_bytes if memory_limit is None else memory_limit)
    chunks = layer_chunks(bg, layout.pp * layout.vpp, index, encoders_first=layout.encoders_first,
                          units=layout.chunk_units(len(split_layers(index, layout.encoders_first)[0]),
                                                   len(index.mtp_layers)))
    stages, sync, optimizer, ring = _chunk_stages(bg, index, chunks, layout, cluster, training)
    sg = _chunk_stage_graph(bg, chunks, stages, layout, cluster)
    if memory_first:
        untimed = _untimed_if_over_memory(name, sg, M, limit)
        if untimed is not None:
            return Evaluation(layout=layout, schedule_name=name, microbatches=M, global_batch=global_batch,
                              tokens_per_step=global_batch * tokens_per_sequence, step_time=math.inf,
                              tokens_per_second_per_device=0.0, mfu=0.0, model_flops_per_step=0.0,
                              peak_memory_bytes=untimed[1], memory_limit=limit, breakdown={}, schedule=untimed[0],
                              grad_sync=max(sync), chunks=chunks)
    sched = _run_on_chunks(name, sg, M, layout)
    sync, optimizer = _per_rank_of_copies(sync, name), _per_rank_of_copies(optimizer, name)
    m = metrics(sched)
    # Gradient reduction overlaps the last microbatch's backward (Megatron's --overlap-grad-reduce): buckets
    # are reduced as that backward makes them; only what is left when it ends is exposed.
    ends = _last_backward(sched, layout.pp)
    exposed = [max(0.0, sync[r] - ends[r][1]) for r in range(layout.pp)]
    finish = max(ends[r][0] + exposed[r] for r in range(layout.pp))
    pipeline_end = max(m.makespan, finish)
    step = pipeline_end + max(optimizer)
    tokens = global_batch * tokens_per_sequence
    model_flops = 3.0 * index.forward_flops * global_batch / micro_batch_size
    breakdown = _breakdown(m.busy, [M * r for r in ring] if layout.cp > 1 else None, m.makespan, pipeline_end,
                           max(optimizer))
    return Evaluation(
        layout=layout, schedule_name=name, microbatches=M, global_batch=global_batch, tokens_per_step=tokens,
        step_time=step, tokens_per_second_per_device=tokens / step / cluster.devices,
        mfu=model_flops / step / (cluster.devices * cluster.peak_flops[training.dtype]),
        model_flops_per_step=model_flops,
        peak_memory_bytes=max(m.peak_memory_bytes, default=0.0), memory_limit=limit,
        breakdown=breakdown, schedule=sched, grad_sync=max(sync), chunks=chunks,
        phases=step_phases(sched, max(range(len(m.busy)), key=m.busy.__getitem__) if m.busy else 0, step),
    )


def _busiest_rank_work(stages: list[Stage], optimizer: list[float], pp: int, microbatches: int,
                       with_optimizer: bool = True) -> float:
    """A floor under any step of the layout with Megatron's (interleaved) 1F1B, whose backwards are whole (B):
    over the pipeline ranks r, the most of head_r + M x r's F + I + W + tail_r, plus the longest optimizer step.

    Stage c is chunk c, on rank c mod pp. Rank r runs one pass at a time and
    none before a microbatch's forward has crossed chunks 0..r-1 (head_r,
    their F); its last pass is a B (a forward's B comes after it), after
    which that microbatch's B still crosses chunks r-1..0 (tail_r, their B).
    Transfers are left out (a floor).
    """
    head = tail = 0.0
    floor = 0.0
    for r in range(pp):
        work = microbatches * sum(s.duration("F") + s.duration("I") + s.duration("W") for s in stages
                                  if s.devices == (r,))
        floor = max(floor, head + work + tail)
        head += stages[r].duration("F")
        tail += stages[r].duration("B")
    return floor + (max(optimizer) if with_optimizer else 0.0)


def layout_floor(bg: nx.DiGraph, cluster: Cluster, training: Training, layout: ParallelLayout, *, global_batch: int,
                 micro_batch_size: int, memory_limit: float | None = None, index: ModelIndex | None = None,
                 than: StageGraph | None = None, whole_sync: bool = False, schedule: str | None = None) -> float | None:
    """A lower bound on :func:`evaluate_layout`'s step time for ``layout`` (its busiest rank's work, costed
    without simulating a schedule; with ``whole_sync`` on its :attr:`Evaluation.planner_step`, which has no
    optimizer step and the whole gradient sync after the makespan), or None when its parameters' state alone overflows the memory limit (no
    recomputation makes it fit), or when ``than`` (the stages of the same layout under another recomputation,
    whose schedule overflowed) held no more activations in any stage: Megatron's schedules run a fixed order
    per rank, so the peak would be the same. ``schedule``: as :func:`evaluate_layout` takes it; DualPipe holds
    two copies of the chunks (their parameters twice) and needs an even count of at least 2 x pp microbatches.

    Cheap next to :func:`evaluate_layout` (no schedule is simulated), so
    :func:`search_layouts` ranks every layout by it first.
    """
    index = index or model_index(bg)
    layout = layout.resolved(cluster.devices)
    split = split_layers(index, layout.encoders_first)[0]
    layout.check_model(len(split), index.experts, len(index.mtp_layers), index.heads)
    M = global_batch // (layout.dp * micro_batch_size)
    copies = copies_of_chunks(schedule or "")
    if copies > 1 and (layout.pp % 2 or layout.vpp > 1 or M % 2 or M < 2 * layout.pp):
        raise OpschedError(f"{schedule} needs an even pp, vpp 1 and an even count of at least 2 x pp microbatches")
    # a split's chunks and their blocks by cost class, found once per split: the grid has thousands of layouts
    # of each (the same chunks under every tp, ep, dp and recomputation)
    units = layout.chunk_units(len(split), len(index.mtp_layers))
    key = ("chunk classes", units, layout.encoders_first)
    if key not in index.block_shares:
        chunks = layer_chunks(bg, layout.pp * layout.vpp, index, encoders_first=layout.encoders_first, units=units)
        index.block_shares[key] = [chunk_classes(index, members) for members in chunks]
    classes = index.block_shares[key]
    limit = float(cluster.memory_bytes if memory_limit is None else memory_limit)
    if max(_per_rank_of_copies(_held_param_bytes(bg, index, classes, layout, training), schedule or "")) > limit:
        return None  # checked before the passes are costed: most layouts of a large model end here
    stages, sync, optimizer, _ = _chunk_stages(bg, index, [[b for b, _ in c] for c in classes], layout, cluster,
                                               training, streams=False, comm=(comm := []), classes=classes)
    # (to rounding: the floor sums a chunk's blocks by class, the evaluation block by block)
    if than is not None and all(s.act_bytes >= t.act_bytes * (1 - 1e-9) and s.act_w_bytes >= t.act_w_bytes * (1 - 1e-9)
                                for s, t in zip(stages, than.stages)):
        return None
    optimizer = _per_rank_of_copies(optimizer, schedule or "")
    # the planner's step adds the whole gradient sync to the makespan (which is at least the busiest rank's work):
    # counting it here orders the layouts as the planner ranks them (a layout of many replicas syncs longer)
    after = max(_per_rank_of_copies(sync, schedule or "")) if whole_sync else 0.0
    if copies > 1:
        # rank r runs chunk r for half the microbatches and chunk pp-1-r for the other half; an overlapped F&B
        # pair may hide communication under compute, so its compute and its communication each bound it
        def rank_work(r: int) -> float:
            mine = (r, layout.pp - 1 - r)
            total = M / 2 * sum(stages[c].duration(p) for c in mine for p in "FIW")
            hidden = M / 2 * sum(comm[c] for c in mine)
            return max(total - hidden, hidden)

        return max(map(rank_work, range(layout.pp))) + (after if whole_sync else max(optimizer))
    return _busiest_rank_work(stages, optimizer, layout.pp, M, with_optimizer=not whole_sync) + after


def _untimed_if_over_memory(name: str, sg: StageGraph, microbatches: int, limit: float
                            ) -> tuple[Schedule, float] | None:
    """(the schedule ``name`` would run, with no events; its peak bytes per device) when that peak overflows
    ``limit``, else None. The peak comes from each rank's order, without timing it."""
    try:
        placed = placed_stage_graph(name, sg, microbatches)
        order = baseline_order(name, placed, microbatches)
    except Unsupported:
        return None  # run_baseline refuses it with the reason
    held = order_peak_activation(placed, order)
    params = device_param_bytes(placed)
    peak = max(params[d] + held.get(d, 0.0) for d in range(len(params)))
    if peak <= limit * (1 + 1e-9):
        return None
    return Schedule(placed, microbatches, [], name=name), peak


def _breakdown(busy: list[float], context: list[float] | None, makespan: float, pipeline_end: float,
               optimizer: float) -> dict[str, float]:
    """Where the step goes, summing to it: the busiest rank's work (its exposed K/V ring apart when ``context``), ...

    >>> parts = _breakdown([3.0, 4.0], [0.5, 1.0], makespan=5.0, pipeline_end=5.5, optimizer=0.5)
    >>> parts["compute_and_exposed_parallel_comm"], parts["context_comm"], sum(parts.values())
    (3.0, 1.0, 6.0)
    """
    busiest = max(range(len(busy)), key=busy.__getitem__) if busy else 0
    compute = busy[busiest] if busy else 0.0
    ring = context[busiest] if context else 0.0  # within the busiest rank's busy time
    out = {"compute_and_exposed_parallel_comm": compute - ring}
    if context is not None:
        out["context_comm"] = ring
    out.update({"pipeline_bubbles": makespan - compute, "exposed_gradient_sync": pipeline_end - makespan,
                "optimizer_step": optimizer})
    return out


def _chunk_stages(
    bg: nx.DiGraph, index: ModelIndex, chunks: list[list[int]], layout: ParallelLayout, cluster: Cluster,
    training: Training, streams: bool = True, comm: list[float] | None = None,
    classes: list[list[tuple[int, int]]] | None = None,
) -> tuple[list[Stage], list[float], list[float], list[float]]:
    """One stage per chunk on its pipeline rank, with each rank's gradient sync, optimizer step and exposed K/V ring;
    without ``streams`` the stages carry no stream operations (a floor needs only the passes' times). ``comm``:
    a list that receives each chunk's communication in F and I per microbatch; ``classes``: each chunk's blocks by
    cost class (:func:`opsched.plan.chunk_cost.chunk_classes`), summed per class without ``streams``."""
    stages, sync, optimizer, ring = [], [0.0] * layout.pp, [0.0] * layout.pp, [0.0] * layout.pp
    cluster_key = _cluster_key(cluster)  # the same for every chunk
    for c, members in enumerate(chunks):
        rank = c % layout.pp
        cost = _chunk_cost(bg, index, members, layout, cluster, cluster_key, training, rank,
                           streams=streams and training.overlap_pairs, classes=None if streams else classes[c]
                           if classes else None)
        stages.append(Stage(id=c, devices=(rank,), time={"F": cost.F, "I": cost.I, "W": cost.W},
                            param_bytes=cost.param_bytes, act_bytes=cost.act_bytes, act_w_bytes=cost.act_w_bytes,
                            name=f"chunk{c}", streams=cost.streams if training.overlap_pairs else None))
        sync[rank] += cost.grad_sync
        optimizer[rank] += cost.optimizer
        ring[rank] += cost.context_ring
        if comm is not None:
            comm.append(cost.comm)
    return stages, sync, optimizer, ring


def _held_param_bytes(bg: nx.DiGraph, index: ModelIndex, chunks: list[list[tuple[int, int]]],
                      layout: ParallelLayout, training: Training) -> list[float]:
    """Per pipeline rank: the bytes of parameter state (weights, gradients, optimizer) one device holds, as
    :func:`_chunk_cost` counts them, without costing any pass; ``chunks``: each chunk's blocks by cost class
    (:func:`opsched.plan.chunk_cost.chunk_classes`)."""
    held = [0.0] * layout.pp
    # a block's held bytes by its cost class, under what decides them (kept on the index like the blocks' shares)
    by_class = index.block_shares.setdefault(("held", layout.tp, layout.ep, layout.etp, layout.dp, layout.cp,
                                              layout.zero, training), {})
    for c, members in enumerate(chunks):
        for b, n in members:
            k = index.cost_class[b]
            if k not in by_class:
                by_class[k] = _block_held_bytes(bg.nodes[b]["block"], index.experts_of[b] > 0, layout, training)
            held[c % layout.pp] += n * by_class[k]
    return held


def _chunk_stage_graph(bg: nx.DiGraph, chunks: list[list[int]], stages: list[Stage], layout: ParallelLayout,
                       cluster: Cluster) -> StageGraph:
    """The chunks' stages on the pipeline ranks, each chunk boundary an edge timed as its point-to-point transfer."""
    crossing = _boundary_bytes(bg, chunks)
    edges = [Edge(c, c + 1, time=_boundary_time(crossing[c], c, layout, cluster), bytes=crossing[c])
             for c in range(len(chunks) - 1)]
    return StageGraph(stages, edges, num_devices=layout.pp)


#: schedules that run two copies of the chunks, in opposite directions, each rank holding chunk r of one and chunk
#: pp-1-r of the other (DualPipe: "2x parameters", arXiv 2412.19437 §3.2.1, Table 2)
TWO_COPY_SCHEDULES = ("dualpipe",)


def copies_of_chunks(schedule: str) -> int:
    """How many copies of the chunks ``schedule`` runs (2 for DualPipe, else 1)."""
    return 2 if schedule in TWO_COPY_SCHEDULES else 1


def _per_rank_of_copies(per_rank: list[float], schedule: str) -> list[float]:
    """A rank's gradient sync or optimizer step when ``schedule`` runs two copies: its own chunk's and the mirrored
    one's (rank r holds chunks r and pp-1-r, both synced and updated)."""
    if copies_of_chunks(schedule) == 1:
        return per_rank
    return [a + b for a, b in zip(per_rank, reversed(per_rank))]


def _run_on_chunks(name: str, sg: StageGraph, microbatches: int, layout: ParallelLayout) -> Schedule:
    """Schedule ``name`` run on the chunks as they are (one stage per chunk); refused when it cannot, or regroups them."""
    try:
        sched = run_baseline(name, sg, microbatches)
    except Unsupported as exc:
        raise OpschedError(f"schedule {name} cannot run this layout: {exc}") from None
    if len(sched.stage_graph.stages) != len(sg.stages) * copies_of_chunks(name):
        # the chunks a rank must hold for the schedule to run them as they are: how to get it, not only what else runs
        per_rank = baseline_module(name).stages_per_device(layout.pp, layout.pp)
        raise OpschedError(f"schedule {name} regroups the {len(sg.stages)} chunks: it runs {per_rank} per pipeline "
                           f"rank, the layout {layout.vpp}; set vpp={per_rank} for {name}, or pick a schedule for "
                           f"pp={layout.pp}, vpp={layout.vpp} (1f1b for vpp=1, interleaved-1f1b for vpp>1)")
    return sched


def _boundary_bytes(bg: nx.DiGraph, chunks: list[list[int]]) -> list[float]:
    """Bytes each chunk boundary c -> c+1 carries: every block edge from chunk <= c to a chunk > c."""
    chunk_of = {b: c for c, members in enumerate(chunks) for b in members}
    crossing = [0.0] * max(0, len(chunks) - 1)
    for u, v, d in bg.edges(data=True):
        for c in range(chunk_of[u], chunk_of[v]):
            crossing[c] += d.get("bytes", 0.0)
    return crossing


def _boundary_time(nbytes: float, c: int, layout: ParallelLayout, cluster: Cluster) -> float:
    """The activation sent from chunk c to c+1 (a point-to-point transfer between pipeline ranks; each rank sends its 1/(tp·cp))."""
    a, b = c % layout.pp, (c + 1) % layout.pp
    src = _rank_devices(layout, cluster.devices, a).tensor
    dst = _rank_devices(layout, cluster.devices, b).tensor
    if src == dst:
        return 0.0
    bw, lat = cluster.link(src, dst)
    return lat + nbytes / (layout.tp * layout.cp) / bw  # each context rank sends its part of the sequence


def _last_backward(sched: Schedule, ranks: int) -> list[tuple[float, float]]:
    """Per pipeline rank: (end of its last backward job, time its last microbatch's backwards took)."""
    ends, windows = [0.0] * ranks, [0.0] * ranks
    last_mb = sched.microbatches - 1
    for e in sched.events:  # one pass: a scan of every event per rank is quadratic at pp 128 x 256 microbatches
        if e.pass_ == "F":
            continue
        for r in sched.stage_graph.stage(e.stage).devices:
            if r < ranks:
                ends[r] = max(ends[r], e.end)
                if e.microbatch == last_mb:
                    windows[r] += e.end - e.start
    return list(zip(ends, windows))
