"""The Megatron-style layout search: the layouts a user could run, and the fastest that fit.

:func:`layout_grid` enumerates Megatron-style layouts (tp within a node, pp dividing the layers, with the ends
counted as layers where needed, or split unevenly by a layout string, vpp, ep folded over dp or tp x dp, cp for
long sequences), :func:`layout_schedules` their schedules (DualPipe on a MoE model), and :func:`search_layouts`
evaluates them best first with :func:`opsched.plan.layouts.evaluate_layout`, in the order of their
:func:`opsched.plan.layouts.layout_floor`, keeping the fastest that fit (docs/cost-model.md, "Searching layouts").
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from typing import Callable

import networkx as nx

from opsched.cost.cluster import RECOMPUTE_MODES, Cluster, Training, with_devices
from opsched.errors import OpschedError
from opsched.model.recompute_modules import modules_without_parts
from opsched.cost.parallel_layout import ParallelLayout
from opsched.cost.pipeline_split import balanced_layout, compact_pipeline_layout, work_balanced_layout
from opsched.schedule import StageGraph
from opsched.units import plain
from opsched.plan.layouts import Evaluation, ModelIndex, block_units, evaluate_layout, layout_floor, model_index

log = logging.getLogger(__name__)


#: virtual pipeline degrees the layout search tries (each must divide the layers per pipeline rank): every degree
#: up to 8, not only powers of 2, since Megatron takes any that divides; Mixtral-8x22B's published PP8 VPP7 (56
#: layers, one a chunk) is the fastest layout that fits there and was missed with (1, 2, 4, 8)
SEARCH_VPP = tuple(range(1, 9))

#: context-parallel degrees the layout search tries, and the shortest sequence it tries them on. In the cost
#: model cp never makes a rank's work cheaper (its tokens are 1/(cp·dp) of a step's either way, and the K/V
#: ring is at best hidden behind the attention core); it wins through memory (activations split cp ways, so
#: less recomputation) or a global batch too small for dp replicas on every device, both the long-sequence
#: case: on models/llama3_8b.onnx, 8 H100s, global batch 32, `opsched evaluate` predicts tp1 cp2 dp4 zero1 as
#: fast as tp1 dp8 zero1 at seq 4096 (both fit), and 25 % faster at 8192 (tp1 dp8 needs full recomputation
#: there). Shorter sequences are not tried, to keep the search small (docs/cost-model.md, "Searching layouts").
SEARCH_CP = (2, 4, 8)
CP_MIN_SEQ_LEN = 8192


def context_degrees(per_pipeline_rank: int, tp: int, devices_per_node: int, seq_len: int) -> list[int]:
    """The cp degrees :func:`layout_grid` tries with ``tp`` on ``per_pipeline_rank`` devices (1, and more for long sequences).

    cp from :data:`SEARCH_CP` when ``seq_len`` is at least :data:`CP_MIN_SEQ_LEN`, dividing the devices of a
    pipeline rank over tp, with the tp x cp ranks that split one sequence within a node (the ring stays on
    NVLink) and the sequence a multiple of 2·cp (Megatron and torchtitan split it into 2·cp chunks to
    balance causal attention).

    >>> context_degrees(8, 1, 8, 65536), context_degrees(8, 2, 8, 65536), context_degrees(8, 1, 8, 4096)
    ([1, 2, 4, 8], [1, 2, 4], [1])
    """
    if seq_len < CP_MIN_SEQ_LEN:
        return [1]
    return [1] + [c for c in SEARCH_CP if (per_pipeline_rank // tp) % c == 0 and devices_per_node % (tp * c) == 0
                  and seq_len % (2 * c) == 0]


def layout_grid(devices: int, devices_per_node: int, layers: int, experts: int, zero: int = 1,
                seq_len: int = 0, tp_overlap: bool = False, attention: str = "fused",
                mtp_layers: int = 0, uneven: bool = True, heads: int = 0) -> list[ParallelLayout]:
    """Megatron-style layouts a user could run on ``devices``: the space :func:`search_layouts` evaluates.

    tp up to a node (tensor groups stay on NVLink) dividing the attention
    ``heads`` (:attr:`ModelIndex.heads`; 0: any), pp dividing the layers
    (and, where none divides them, with ``uneven`` the uneven splits of
    :func:`uneven_splits` as Megatron-Core's ``pipeline_layout`` strings over
    ``layers`` decoder and ``mtp_layers`` MTP layers), vpp from :data:`SEARCH_VPP` dividing the layers
    per rank, ep the experts' divisors that divide dp (folded over the
    replicas) and, with tp > 1, those dividing tp x dp with etp 1 (Megatron-Core's
    parallel folding), cp from :func:`context_degrees` for a sequence of
    ``seq_len`` tokens (with ep = 1: cp with ep is not modelled), sequence
    parallelism whenever tp > 1, and ZeRO level ``zero`` (default 1, the
    distributed optimizer: the same gradient traffic as an all-reduce, less
    memory), and with ``tp_overlap`` Megatron's ``--tp-comm-overlap`` wherever
    tp > 1; every layout runs ``attention`` (the user's kernel, not a choice
    of the search).

    >>> [str(l) for l in layout_grid(4, 4, layers=2, experts=0)]
    ['tp1 pp1 dp4 zero1', 'tp1 pp2 dp2 zero1', 'tp2 pp1 dp2 sp zero1', 'tp2 pp2 dp1 sp zero1', 'tp4 pp1 dp1 sp zero1']
    >>> [str(l) for l in layout_grid(4, 4, layers=2, experts=0, seq_len=8192) if l.cp > 1]
    ['tp1 pp1 cp2 dp2 zero1', 'tp1 pp1 cp4 dp1 zero1', 'tp1 pp2 cp2 dp1 zero1', 'tp2 pp1 cp2 dp1 sp zero1']
    >>> [str(l) for l in layout_grid(4, 4, layers=5, experts=0) if l.pipeline_layout][:2]
    ['tp1 pp2 dp2 zero1 pipeline_layout=Et*3|ttL', 'tp2 pp2 dp1 sp zero1 pipeline_layout=Et*3|ttL']
    >>> sorted({l.tp for l in layout_grid(8, 8, layers=4, experts=0, heads=6)})   # 6 heads: no tp4, no tp8
    [1, 2]
    """
    grid = []
    tps = [t for t in range(1, min(devices, devices_per_node) + 1) if devices % t == 0 and devices_per_node % t == 0
           and not (heads and heads % t)]
    for tp in tps:
        splits = []  # (pp, vpps, ends_as_layers, pipeline_layout per vpp)
        for pp, ends in pipeline_depths(layers, devices // tp):
            units = layers + 2 * ends  # what the pp x vpp chunks split: the layers, and the ends if they count
            vpps = [v for v in SEARCH_VPP if pp > 1 and units % (pp * v) == 0
                    and units // (pp * v) > ends] or [1]  # counted ends leave a layer in the first and last chunk
            splits += [(pp, vpp, ends, "") for vpp in vpps]
        if uneven:
            splits += [(pp, vpp, False, text) for pp, vpp, text in uneven_splits(layers, mtp_layers, devices // tp)]
        for pp, vpp, ends, text in splits:
            for cp in context_degrees(devices // pp, tp, devices_per_node, seq_len):
                dp = devices // (tp * pp * cp)
                for ep, etp in expert_degrees(experts, tp, dp) if cp == 1 else [(1, 0)]:  # cp with ep: not modelled
                    # sequence parallel with tensor parallel, as Megatron recommends and opsched exports plans
                    grid.append(ParallelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, cp=cp, dp=dp, sp=tp > 1,
                                               zero=zero, ends_as_layers=ends, tp_overlap=tp_overlap and tp > 1,
                                               attention=attention, pipeline_layout=text))
    return grid


def expert_degrees(experts: int, tp: int, dp: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs :func:`layout_grid` tries: ep dividing the experts and dp with the experts' tensor
    parallelism that of the layer (etp 0: tp), and, with tp > 1, ep dividing tp x dp with etp 1 (Megatron-Core's
    parallel folding: Megatron-Bridge runs DeepSeek-V3 at TP2 EP64 ETP1). ``[(1, 0)]`` for a dense model.

    >>> expert_degrees(8, 2, 2)
    [(1, 0), (2, 0), (1, 1), (2, 1), (4, 1)]
    >>> expert_degrees(0, 2, 2)
    [(1, 0)]
    """
    if not experts:
        return [(1, 0)]
    folded = [(e, 0) for e in range(1, experts + 1) if experts % e == 0 and dp % e == 0]
    if tp > 1:
        folded += [(e, 1) for e in range(1, experts + 1) if experts % e == 0 and (tp * dp) % e == 0]
    return folded


#: the fewest units (embedding, layer, MTP layer or loss) an uneven split's chunk holds on average: Megatron-Bridge's
#: DeepSeek-V3 layout ``Et|(tt|)*30mL`` has 2; more chunks only add transfers and keeps the grid small
UNEVEN_MIN_UNITS = 2


def uneven_splits(layers: int, mtp_layers: int, devices: int) -> list[tuple[int, int, str]]:
    """(pp, vpp, pipeline_layout) for the pp dividing ``devices`` that split ``layers`` neither evenly nor with the
    ends counted as layers (:func:`pipeline_depths`): each pp x vpp chunks of the balanced layout string
    (:func:`opsched.cost.pipeline_split.balanced_layout`: the embedding in the first chunk, the MTP layers and the
    loss in the last, the first and last chunks the lightest), with at least :data:`UNEVEN_MIN_UNITS` units a
    chunk on average. 61 layers + 1 MTP layer on 16 ranks: DeepSeek-V3's PP16 and Megatron-Bridge's PP8 VP4.

    >>> [(pp, vpp, t) for pp, vpp, t in uneven_splits(61, 1, 16) if (pp, vpp) in ((16, 1), (8, 4))]
    [(8, 4, 'Et|(tt|)*30mL'), (16, 1, 'Et*3|(t*4|)*14ttmL')]
    """
    even = {pp for pp, _ in pipeline_depths(layers, devices)}
    units = layers + mtp_layers + 2
    out = []
    for pp in range(2, devices + 1):
        if devices % pp or pp in even:
            continue
        for vpp in SEARCH_VPP:
            if pp * vpp * UNEVEN_MIN_UNITS > units:
                break
            chunks = balanced_layout(layers, mtp_layers, pp * vpp)
            if chunks and all(chunks):
                out.append((pp, vpp, compact_pipeline_layout(chunks)))
    return out


#: layers whose work differs by more than this ratio (a vision encoder's layers beside a language model's) get
#: pipeline splits balanced by work besides those of equal layer counts (:func:`work_balanced_variants`)
UNEQUAL_LAYERS = 1.5


def unit_work(bg: nx.DiGraph, index: ModelIndex) -> tuple[str, list[float]]:
    """(a layout string's units in model order: E, every decoder layer t, MTP layer m, then L; each unit's forward
    FLOPs, every block counted with the unit :func:`opsched.plan.layouts.block_units` gives it)."""
    letters = "E" + "t" * len(index.layers) + "m" * len(index.mtp_layers) + "L"
    work = [0.0] * len(letters)
    for b, unit in block_units(bg, index).items():
        work[unit] += bg.nodes[b]["block"].flops
    return letters, work


def work_balanced_variants(layouts: list[ParallelLayout], bg: nx.DiGraph, index: ModelIndex) -> list[ParallelLayout]:
    """For a model whose layers differ in work by more than :data:`UNEQUAL_LAYERS` (Optimus's ViT-22B + GPT-175B:
    an encoder layer is about 3 % of a language-model layer), each layout of ``layouts`` with two chunks or more
    split by :func:`~opsched.cost.pipeline_split.work_balanced_layout` instead, as a ``pipeline_layout`` string,
    where that differs from its own split (equal layer counts put the encoder's light layers in chunks of their
    own, which then idle); none for a model of equal layers."""
    letters, work = unit_work(bg, index)
    layer_work = work[1:1 + len(index.layers)]  # decoder layers: an MTP layer or a head may be heavier alone
    if not layer_work or max(layer_work) <= UNEQUAL_LAYERS * max(min(layer_work), 1e-30):
        return []
    out, seen = [], {str(lay) for lay in layouts}
    for lay in layouts:
        chunks = lay.pp * lay.vpp
        balanced = work_balanced_layout(letters, work, chunks) if chunks > 1 else None
        if balanced is None:
            continue
        text = compact_pipeline_layout(balanced)
        own = lay.chunk_units(len(index.layers), len(index.mtp_layers))
        variant = dataclasses.replace(lay, pipeline_layout=text, ends_as_layers=False, first_layers=0, last_layers=0)
        if tuple(balanced) != tuple(own) and str(variant) not in seen:
            seen.add(str(variant))
            out.append(variant)
    return out


def pipeline_depths(layers: int, devices: int) -> list[tuple[int, bool]]:
    """(pp, ends_as_layers) pairs :func:`layout_grid` tries on ``devices`` devices of one tensor-parallel rank each.

    pp dividing the devices and the layers; and, where it divides the devices
    but not the layers, pp dividing the layers + 2 with the embedding and the
    head counted as one layer each (``ends_as_layers``: Megatron-Core's
    ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``,
    DeepSpeed's ``type:transformer|embedding``), each chunk keeping a layer.
    BLOOM-176B's 70 layers on 384 A100s (3 x 128) need it: no pp that divides
    70 takes the factor 3, so without it every layout leaves devices idle.

    >>> pipeline_depths(70, 96)
    [(1, False), (2, False), (3, True), (4, True), (6, True), (8, True), (12, True), (24, True)]
    """
    plain = [(p, False) for p in range(1, layers + 1) if layers % p == 0 and devices % p == 0]
    ends = [(p, True) for p in range(2, (layers + 2) // 2 + 1)
            if (layers + 2) % p == 0 and layers % p and devices % p == 0]
    return sorted(plain + ends)


def _costed_layouts(bg: nx.DiGraph, cluster: Cluster, training: Training, grid: list[GridEntry], o: LayoutSearch,
                    index: ModelIndex) -> list[tuple[float, int, int, ParallelLayout]]:
    """A heap of (floor, grid position, 0, layout with ``o.recompute[0]``) for every layout of ``grid`` whose
    replicas divide the global batch and whose parameters' state fits (:func:`layout_floor`)."""
    heap: list[tuple[float, int, int, ParallelLayout]] = []
    for k, candidate in enumerate(grid):
        if o.deadline is not None and time.monotonic() > o.deadline:
            log.info("layouts: the time limit was spent: %s of %s not costed", plain(len(grid) - k), plain(len(grid)))
            break
        if o.global_batch % candidate[0].dp == 0:
            _push_costed(heap, bg, cluster, training, o, index, candidate, k, 0)
    return heap


def _push_costed(heap: list, bg: nx.DiGraph, cluster: Cluster, training: Training, o: LayoutSearch,
                 index: ModelIndex, candidate: GridEntry, k: int, r: int, than: StageGraph | None = None) -> None:
    """Push ``candidate``'s layout (grid position ``k``) with recomputation ``o.recompute[r]`` and its floor, or with
    the first later setting that could fit where that one cannot (:func:`layout_floor`, ``than`` as there); nothing
    when none can or the model cannot take the layout."""
    layout, schedule = candidate
    for r in range(r, len(o.recompute)):
        lay = with_recompute(layout, o.recompute[r])
        try:
            floor = layout_floor(bg, with_devices(cluster, layout.devices), training, lay,
                                 global_batch=o.global_batch, micro_batch_size=1, memory_limit=o.memory_limit,
                                 index=index, than=than, whole_sync=o.whole_sync, schedule=schedule)
        except OpschedError:
            return  # a layout the model cannot take (evaluate_layout would refuse it too)
        if floor is not None:
            heapq.heappush(heap, (floor, k, r, lay))
            return
        if than is None:
            return  # its parameters' state overflows: so with every setting


#: a layout with its schedule (None: Megatron's 1F1B, interleaved when vpp > 1)
GridEntry = tuple[ParallelLayout, "str | None"]

#: recomputation by module (Megatron-Core's ``--recompute-modules``) the search tries on a MoE model between no
#: recomputation and the selective one: DeepSeek-V3's own (RMSNorm and the MLA up-projections, arXiv 2412.19437
#: §3.2.3, and the experts' SwiGLU output from its cached inputs, §3.3.3) and Megatron-Bridge's for DeepSeek-V3
#: (the MLA up-projections and the dense MLPs)
MODULE_SETTINGS = ("modules:layernorm+mla_up_proj+moe_act", "modules:mla_up_proj+mlp")


def recompute_ladder(modes: tuple[str, ...], experts: int, present: set[str] | None = None) -> tuple[str, ...]:
    """The recomputation settings :func:`search_layouts` tries in turn: ``modes`` and, on a MoE model
    (``experts``) searched with every mode, :data:`MODULE_SETTINGS` after the first, each without the modules
    the model has no part of (``present``: the parts its blocks hold; Megatron-Core refuses ``mla_up_proj``
    without multi-latent attention, and recomputing a module a model lacks changes nothing), a setting left
    empty or repeated dropped.

    >>> recompute_ladder(RECOMPUTE_MODES, 8)
    ('none', 'modules:layernorm+mla_up_proj+moe_act', 'modules:mla_up_proj+mlp', 'selective', 'full')
    >>> recompute_ladder(RECOMPUTE_MODES, 8, present={"layernorm", "moe_act"})  # Mixtral: no MLA, no dense MLP
    ('none', 'modules:layernorm+moe_act', 'selective', 'full')
    >>> recompute_ladder(RECOMPUTE_MODES, 0) == RECOMPUTE_MODES
    True
    """
    if not experts or tuple(modes) != tuple(RECOMPUTE_MODES):
        return tuple(modes)
    settings: list[str] = []
    for setting in MODULE_SETTINGS:
        modules = setting.removeprefix("modules:").split("+")
        absent = set(modules_without_parts(modules, present)) if present is not None else set()
        kept = "modules:" + "+".join(m for m in modules if m not in absent)
        if kept != "modules:" and kept not in settings:
            settings.append(kept)
    return modes[:1] + tuple(settings) + tuple(modes[1:])


def with_recompute(layout: ParallelLayout, setting: str) -> ParallelLayout:
    """``layout`` with one setting of :func:`recompute_ladder`: a recompute mode, or ``modules:`` Megatron's modules.

    >>> str(with_recompute(ParallelLayout(), "modules:layernorm+mla_up_proj"))
    'tp1 pp1 dp0 recompute_modules=layernorm+mla_up_proj'
    """
    if setting.startswith("modules:"):
        return dataclasses.replace(layout, recompute="none", recompute_modules=setting.removeprefix("modules:"))
    return dataclasses.replace(layout, recompute=setting, recompute_modules="")


#: schedules the search tries beside Megatron's (interleaved) 1F1B where a layout allows them: DualPipe
#: (DeepSeek-V3's, arXiv 2412.19437 §3.2.1) on an even pp with one chunk a rank
EXTRA_SCHEDULES = ("dualpipe",)


def layout_schedules(layout: ParallelLayout, experts: int) -> list[str | None]:
    """The schedules :func:`search_layouts` runs ``layout`` with: Megatron's (None) and, on a MoE model
    (``experts``, what DualPipe was made for: its overlap hides the expert all-to-all), :data:`EXTRA_SCHEDULES`
    where the layout allows them (an even pp of at least 2 and vpp 1). Dense models keep Megatron's schedules
    alone, as their published rows ran.

    >>> layout_schedules(ParallelLayout(pp=4), 8), layout_schedules(ParallelLayout(pp=4, vpp=2), 8)
    ([None, 'dualpipe'], [None])
    >>> layout_schedules(ParallelLayout(pp=4), 0)
    [None]
    """
    allowed = experts and layout.pp >= 2 and layout.pp % 2 == 0 and layout.vpp == 1
    return [None] + (list(EXTRA_SCHEDULES) if allowed else [])


def device_counts(devices: int) -> list[int]:
    """``devices`` and its halvings down to one device: the counts :func:`search_layouts` tries with ``fewer_devices``.

    >>> device_counts(24)
    [24, 12, 6, 3]
    """
    counts = [devices]
    while counts[-1] % 2 == 0:
        counts.append(counts[-1] // 2)
    return counts


@dataclasses.dataclass(frozen=True)
class LayoutSearch:
    """What :func:`search_layouts` searches for: the batch, the memory, and how much of the grid."""

    global_batch: int
    """Sequences a step; a layout whose data-parallel replicas do not divide it is skipped."""
    tokens_per_sequence: int
    """The sequence length (context parallelism is tried only on long ones)."""
    memory_limit: float | None = None
    """Bytes per device (``None``: the cluster's memory)."""
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    """The recomputation settings to climb (:func:`recompute_ladder`): a layout keeps the first that fits."""
    keep: int = 1
    """How many of the fastest layouts to return (with 1 the search stops at the first floor not below the best)."""
    zero: int = 1
    """The ZeRO stage every layout takes."""
    fewer_devices: bool = False
    """Try the layouts on the first half, quarter, ... of the devices too (the rest idle)."""
    accept: Callable[[Evaluation], bool] | None = None
    """A layout that fits but is not accepted (a runtime that cannot run it) is left out."""
    deadline: float | None = None
    """A :func:`time.monotonic` instant past which the layouts not yet tried are skipped."""
    whole_sync: bool = False
    """Rank by :attr:`Evaluation.planner_step` (how ``opsched plan`` counts every candidate), not the step time."""


def search_layouts(bg: nx.DiGraph, cluster: Cluster, training: Training, search: LayoutSearch | None = None, /,
                   **changes) -> list[Evaluation]:
    """The ``keep`` fastest layouts of :func:`layout_grid` that fit, evaluated at micro-batch size 1.

    ``search`` (a :class:`LayoutSearch`; keyword ``changes`` replace its fields, or make it when it is not given)
    says what is searched for. ``bg`` is the model imported with one sequence per microbatch. Each layout
    runs with each of :func:`layout_schedules` (DualPipe beside Megatron's
    1F1B on a MoE model). A layout is tried with each setting of
    :func:`recompute_ladder` over ``recompute`` in turn and kept with the first
    that fits; uneven pipeline splits are tried on all the devices only; layouts whose replicas do not divide the global batch, or whose
    parameters' state alone overflows the memory, are skipped. Best first:
    every layout's :func:`layout_floor` is costed first (no schedule is
    simulated), and the layouts are simulated in the order of their floors, so
    with ``keep=1`` the search stops at the first floor not below the best step
    so far (no layout left can win); a time limit then cuts the least
    promising layouts. With
    ``fewer_devices`` the layouts on the first half, quarter, ... of the
    devices are tried too (the rest idle): a global batch too small for
    every device, or replicas that would straddle nodes, can make those
    faster. ``accept``: a layout that fits but is not accepted (a runtime
    that cannot run it) is left out. Past ``deadline`` (a
    :func:`time.monotonic` instant) the layouts not yet tried are skipped
    (a log line says how many). With ``training.tp_comm_overlap`` every
    layout with tp > 1 overlaps its tensor-parallel collectives. With
    ``whole_sync`` layouts are ranked by :attr:`Evaluation.planner_step`
    (how ``opsched plan`` counts every candidate), not by the step time, so
    a layout with more replicas, whose larger sync the step time partly hides,
    does not win on a count the planner does not use.
    """
    o = LayoutSearch(**changes) if search is None else dataclasses.replace(search, **changes)
    counted = (lambda e: e.planner_step) if o.whole_sync else (lambda e: e.step_time)
    index = model_index(bg)
    counts = device_counts(cluster.devices) if o.fewer_devices else [cluster.devices]
    grid = [(lay, schedule) for n in counts
            for lay in layout_grid(n, cluster.devices_per_node, len(index.layers), index.experts, o.zero,
                                   seq_len=o.tokens_per_sequence, tp_overlap=training.tp_comm_overlap,
                                   attention=training.attention, mtp_layers=len(index.mtp_layers),
                                   uneven=n == cluster.devices,  # bounded: the halvings keep the even splits
                                   heads=index.heads)
            for schedule in layout_schedules(lay, index.experts)]
    grid += [(lay, schedule) for lay in work_balanced_variants(list(dict.fromkeys(lay for lay, _ in grid)), bg, index)
             for schedule in layout_schedules(lay, index.experts)]
    present = {part.part for b in bg for part in bg.nodes[b]["block"].parts}
    o = dataclasses.replace(o, recompute=recompute_ladder(o.recompute, index.experts, present))
    # best first: (floor, grid position, recompute position) in a heap; a layout's next recomputation setting
    # joins it only when the one before does not fit, with its own (higher) floor
    heap = _costed_layouts(bg, cluster, training, grid, o, index)
    found: list[Evaluation] = []
    while heap:
        floor, k, r, layout = heapq.heappop(heap)
        best = min((counted(f) for f in found), default=None) if o.keep == 1 else None
        if best is not None and floor >= best:
            break  # the floors only rise from here: no layout left beats the best
        if o.deadline is not None and time.monotonic() > o.deadline:
            log.info("layouts: the time limit was spent: %s that fit not simulated (the least promising)",
                     plain(len(heap) + 1))
            break
        try:
            e = evaluate_layout(bg, with_devices(cluster, layout.devices), training, layout,
                                global_batch=o.global_batch, micro_batch_size=1,
                                tokens_per_sequence=o.tokens_per_sequence, memory_limit=o.memory_limit, index=index,
                                memory_first=True, schedule=grid[k][1])
        except OpschedError:
            continue  # the schedule cannot run this layout (e.g. too few microbatches for interleaving)
        if e.fits:
            if o.accept is None or o.accept(e):
                found.append(e)
        elif r + 1 < len(o.recompute):  # the next setting that stores less (one that does not would peak the same)
            _push_costed(heap, bg, cluster, training, o, index, grid[k], k, r + 1, than=e.schedule.stage_graph)
    # on a tie (to the nanosecond: sums of the same work in another order differ in the last bits) the layout
    # that uses more devices goes first: it leaves none idle for nothing; then the one with the fewest
    # context-parallel ranks (a shorter K/V ring for the same step)
    return sorted(found, key=lambda e: (round(counted(e), 9), -e.layout.devices, e.layout.cp, str(e.layout)))[:o.keep]
