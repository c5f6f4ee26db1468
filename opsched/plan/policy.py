"""How ``opsched plan`` spends its time: the searches it runs (the planner's, the Megatron-style layouts,
again with recomputation or Adam's state in BF16 when nothing fits), what it keeps for a runtime, and what a
reader of the chosen plan must be warned about."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from opsched.cost.blocks import Mode, expert_count
from opsched.cost.cluster import OPTIMIZER_STATE_BYTES, RECOMPUTE_MODES, Cluster
from opsched.errors import MemoryTooSmall, NoRunnablePlan, OpschedError
from opsched.export.plan_layout import layer_stack_of, one_layer_stack
from opsched.export.runtimes import ANY, layout_fields, refusal, runtime_named
from opsched.model.coarsen import coarsen
from opsched.model.onnx_import import import_onnx, routing_assumptions
from opsched.plan.contiguous import on_real_devices
from opsched.plan.layout_search import LayoutSearch, search_layouts
from opsched.plan.plan_records import NO_FIT, Baseline, PlanResult
from opsched.plan.search import PlanOptions, plan_block_graph
from opsched.plan.smallest_memory import SMALLEST_MEMORY_SECONDS, smallest_memory
from opsched.schedule import metrics
from opsched.solving.isolate import usable_cores
from opsched.units import bytes_text, plain, plural, ranges_text, seconds_text
from opsched.upper.layouts import Layout
from opsched.upper.stages import held_block, layer_path, stage_contents

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanRequest:
    """What ``opsched plan`` was asked for beyond the cluster and the training settings: the options its policy
    (which searches run, in which order, and what they may keep) reads."""

    #: the ONNX file (imported again at one sequence per microbatch for the Megatron-style layouts)
    model: str
    #: wall-clock budget of the whole command, in seconds: the import, the search and writing the files
    time_limit: float
    #: the MIP solver (:data:`opsched.solving.solver.SOLVERS`)
    solver: str = "cbc"
    #: solves run at once, each in its own process; None: every core this process may use
    jobs: int | None = None
    #: :data:`~opsched.export.runtimes.ANY`, or the runtime whose plans alone are kept
    #: (:data:`opsched.export.runtimes.RUNTIMES`)
    runtime: str = ANY
    #: "auto" (none, then full recomputation if nothing fits), or one of the recompute modes
    recompute: str = "auto"
    #: "auto" (fp32, then bf16 if only that fits), "fp32" or "bf16": the bytes Adam's state takes per parameter
    optimizer_state: str = "auto"
    #: the MoE capacity factor the model is imported with
    capacity_factor: float = 1.0
    #: stages may form a DAG (a model's branches side by side); False plans the model as one chain
    branches: bool = True


#: seconds the look for a plan with Adam's state in BF16 gets when the time limit is spent: one layout's
#: least-memory MIP
HINT_SECONDS = SMALLEST_MEMORY_SECONDS
#: the part of --time-limit kept for validating the plan and writing its files
EXPORT_SHARE = 0.05

#: and at least this many seconds per job of the largest candidate known before the search (files_deadline):
#: 0.47 ms measured for a 16,384-job plan on 3,072 devices (7.7 s on a 2-core machine at load 1), with a margin
EXPORT_SECONDS_PER_JOB = 6e-4

#: the part of the time left after its own import (at one sequence per microbatch) that the Megatron-style layout
#: search may use (with a global batch): past it the layouts not yet evaluated are skipped, and the planner's search
#: gets the rest
LAYOUT_SEARCH_SHARE = 0.3


def imported(request: PlanRequest, dims: dict[str, int]):
    """(OpGraph, BlockGraph, warnings) of the request's model at ``dims``: the import's assumptions (MoE routing)
    and warnings (masks, unknown ops) start the plan's warnings, so a reader of report.md and plan.json sees what
    the plan rests on, not only stderr; a model the runtime asked for can run no plan of is refused here, before
    the search."""
    # no progress line before the import: a refused --dim is then the only line on stderr
    og = import_onnx(request.model, dims=dims or None, capacity_factor=request.capacity_factor, strict_dims=True)
    bg = coarsen(og)
    check_runtime_model(request.runtime, request.model, bg)
    dims_text = ", ".join(f"{k}={v}" for k, v in og.graph.get("dims", {}).items())
    log.info("import: %s: %s; %s", request.model, plural(og.number_of_nodes(), "operator"),
             f"symbolic dims {dims_text}" if dims_text else "no symbolic dims")
    assumed = routing_assumptions(og)
    for sentence in assumed:
        log.warning("import: assumes %s", sentence)
    for sentence in og.graph.get("warnings") or []:
        log.warning("import: warning: %s", sentence)
    log.info("coarsen: the operators merged into %s (the units the planner places)",
             plural(bg.number_of_nodes(), "block"))
    return og, bg, assumed + list(og.graph.get("warnings") or [])


def whole_layer_batch(request: PlanRequest, training, dims: dict[str, int]) -> int | None:
    """The samples per step a runtime that needs whole layers plans with when no global batch is given (so the
    Megatron-style layouts users run join the baselines and the plan is never slower than the best of them);
    None for a runtime that does not, or a model without a symbolic batch."""
    runtime = runtime_named(request.runtime)
    whole_layers = runtime is not None and runtime.one_configuration and "batch" in dims
    return training.microbatches * training.microbatch_size if whole_layers else None


def files_deadline(deadline: float, time_limit: float, rows: list) -> float:
    """``deadline`` moved earlier when the files of the largest candidate so far (a Megatron-style layout of
    thousands of jobs) need more than :data:`EXPORT_SHARE` of the time limit to write: validating, the runtimes'
    checks, plan.json, the trace and the charts take about :data:`EXPORT_SECONDS_PER_JOB` each.

    >>> from types import SimpleNamespace as Row
    >>> files_deadline(95.0, 100.0, []), files_deadline(95.0, 100.0, [Row(schedule=Row(events=[None] * 20_000))])
    (95.0, 88.0)
    """
    jobs = max((len(row.schedule.events) for row in rows), default=0)
    return min(deadline, deadline + EXPORT_SHARE * time_limit - EXPORT_SECONDS_PER_JOB * jobs)


def plan_with_optimizer_state(request: PlanRequest, bg, cluster, training, limit: float, deadline: float,
                              dims: dict, global_batch: int | None, warnings: list[str]):
    """:func:`plan_with_recompute` with the Megatron-style layouts (with a global batch), and with ``--optimizer-state
    auto`` once more with Adam's state in BF16 when nothing fits in FP32 and something does in BF16 (a sentence in
    ``warnings`` says so); (training as planned, :class:`opsched.plan.plan_records.PlanResult`)."""
    def layouts_today(training) -> tuple[list, bool]:  # within its share of the time left; and whether it ran out
        return megatron_layouts(request, dims, cluster, training, limit, global_batch, deadline) if global_batch \
            else ([], False)

    today, cut = layouts_today(training)
    deadline = files_deadline(deadline, request.time_limit, today)
    try:
        return plan_with_recompute(request, bg, cluster, training, limit, deadline, today, bool(global_batch), cut)
    except StateInBf16Fits as exc:
        if request.optimizer_state != "auto":
            raise
        # Megatron-Core's precision-aware optimizer: what its users turn on when FP32 state does not fit
        log.info("plan: %s; planning again with Adam's state in bf16", exc)
        training = dataclasses.replace(training, optimizer_state="bf16",
                                       recompute="none" if request.recompute == "auto" else request.recompute)
        today, cut = layouts_today(training)
        planned = plan_with_recompute(request, bg, cluster, training, limit, max(deadline, time.monotonic() + 1.0),
                                      today, bool(global_batch), cut)
        warnings.append(f"Adam's state is kept in bf16 ({plain(OPTIMIZER_STATE_BYTES['bf16'])} bytes per parameter, "
                        f"not {plain(OPTIMIZER_STATE_BYTES['fp32'])}: Megatron-Core's precision-aware optimizer) because nothing "
                        f"fits with it in fp32: {exc.fp32_refusal}; pass --optimizer-state fp32 to refuse instead")
        return planned


def plan_with_recompute(request: PlanRequest, bg, cluster, training, limit: float, deadline: float, today: list,
                        searched: bool, cut: bool = False):
    """(training as planned, :class:`opsched.plan.plan_records.PlanResult`): the planner's search, once more with full
    recomputation when nothing fits without it and ``--recompute auto``; for ``--runtime R`` only plans R can run,
    and :class:`NoRunnablePlan` says why none can, and how to widen the search. ``today``: the Megatron-style
    layouts found (``searched``: whether they were looked for; ``cut``: whether their search ran out of time)."""
    runtime = None if runtime_named(request.runtime) is None else request.runtime  # None: any runtime
    options = PlanOptions(memory_limit=limit, time_limit=request.time_limit, solver=request.solver,
                          layouts_run_today=today, runtime=runtime, workers=request.jobs or usable_cores(),
                          branches=request.branches,
                          # with --recompute auto a refusal is planned again with recomputation, which says how
                          # much memory works: the first search's least-memory MIPs would only take its time
                          least_memory_if_none_fits=request.recompute != "auto")

    def plan(training, deadline: float):
        return plan_block_graph(bg, cluster, training, dataclasses.replace(options, deadline=deadline))

    # the planner logs its own progress (opsched.plan.search)
    try:
        try:
            return training, plan(training, deadline=deadline)
        except (MemoryTooSmall, NoRunnablePlan) as exc:
            if request.recompute != "auto" or (isinstance(exc, NoRunnablePlan) and not _memory_bound(exc)):
                raise
            log.info("plan: nothing%s fits without recomputation; planning again with full recomputation, %s left",
                     "" if runtime is None else f" {runtime} can run", seconds_text(max(0.0, deadline - time.monotonic())))
            # the Megatron-style layouts already tried recomputation themselves (--recompute auto): kept as found
            training = dataclasses.replace(training, recompute="full")
            options = dataclasses.replace(options, least_memory_if_none_fits=True)
            now = time.monotonic()
            # with --optimizer-state auto a re-plan with Adam's state in BF16 may follow this one: it keeps half
            # of the time left (this one, should nothing fit, spends its clock to the end on the least memory)
            then = request.optimizer_state == "auto" and training.optimizer_state == "fp32"
            return training, plan(training, deadline=now + (deadline - now) / 2 if then and deadline - now > 2.0
                                  else max(deadline, now + 1.0))
    except MemoryTooSmall as exc:
        raise with_optimizer_state_hint(exc, bg, cluster, training, limit, request.solver, deadline) from None
    except NoRunnablePlan as exc:
        hint = "plan with --runtime any for the fastest plan of any shape"
        if runtime is not None and runtime_named(runtime).one_configuration and not today:
            hint = ("no Megatron-style layout (whole layers, one configuration) was found before the layout search's "
                    f"share of the time limit ran out: pass a larger --time-limit, or {hint}" if searched and cut else
                    "no Megatron-style layout (whole layers, one configuration) fits: pass a larger --memory-limit or "
                    f"more --devices, or {hint}" if searched else
                    "the model has no symbolic batch dimension, so no Megatron-style layout (whole layers, one "
                    f"configuration) was searched; {hint}")
        raise OpschedError(f"{exc}; {hint}") from None


class StateInBf16Fits(MemoryTooSmall):
    """Nothing fits with Adam's state in FP32, and something would in BF16 (the line says so, and how much)."""

    def __init__(self, message: str, smallest: float, fp32_refusal: str):
        super().__init__(message, smallest)
        self.fp32_refusal = fp32_refusal  # the refusal in FP32 alone


def with_optimizer_state_hint(exc, bg, cluster, training, limit: float, solver: str, deadline: float):
    """``exc`` (a :class:`opsched.errors.MemoryTooSmall`), as :class:`StateInBf16Fits` whose line ends with the memory
    Adam's state in BF16 would need when that fits in ``limit`` and the plan kept it in FP32; else ``exc`` itself.

    The look ends by ``deadline`` and within :data:`HINT_SECONDS`; with less than half of that left before
    ``deadline`` it takes :data:`HINT_SECONDS` anyway (every layout's least-memory MIP, unbounded, took 19 s on
    Llama 3 405B at 16 devices, past an 8 s limit). Layouts whose memory floor is over ``limit`` are not solved;
    a look cut short that finds nothing that fits gives ``exc`` itself (the deepest layouts, the likeliest to fit,
    are looked at first)."""
    if training.optimizer_state != "fp32":
        return exc
    lighter = dataclasses.replace(training, optimizer_state="bf16")
    now = time.monotonic()
    until = min(deadline, now + HINT_SECONDS) if deadline > now + HINT_SECONDS / 2 else now + HINT_SECONDS
    smallest = smallest_memory(bg, cluster, lighter, solver, deadline=until, limit=limit)
    if smallest > limit:
        log.info("plan: with Adam's state in bf16 nothing was found that fits in %s per device either",
                 bytes_text(limit))
        return exc
    log.info("plan: with Adam's state in bf16 the least memory per device would be about %s", bytes_text(smallest))
    return StateInBf16Fits(f"{exc}; with --optimizer-state bf16 (Adam's state in "
                           f"{plain(OPTIMIZER_STATE_BYTES['bf16'])} bytes per parameter, not "
                           f"{plain(OPTIMIZER_STATE_BYTES['fp32'])}) it needs about {bytes_text(smallest)}, which fits",
                           smallest, str(exc))


def _memory_bound(exc) -> bool:
    """Whether a :class:`NoRunnablePlan` had candidates refused for memory, which recomputation may fit."""
    return any("memory" in reason for reason in exc.reasons)


def check_runtime_model(runtime: str, model: str, bg) -> None:
    """Refuse, before the search, a model ``runtime`` can run no plan of: Megatron-LM and torchtitan split one
    stack of numbered layers (:func:`opsched.export.plan_layout.one_layer_stack`, the export's own rule)."""
    named = runtime_named(runtime)
    if named is None or not named.one_configuration:
        return
    stacks = [layer_stack_of(layer_path(bg.nodes[b]["block"].name)) for b in bg.nodes]

    def refuse(reason: str) -> OpschedError:
        reason = reason.replace("its stages hold", "it has")
        return OpschedError(f"--runtime {runtime}: {runtime} can run no plan of {model}: {reason}; plan with "
                            "--runtime torch or --runtime any")

    one_layer_stack([s for s in stacks if s is not None], refuse)


def megatron_layouts(request: PlanRequest, dims: dict[str, int], cluster, training, limit: float,
                     global_batch: int, deadline: float | None = None) -> tuple[list, bool]:
    """(the fastest Megatron-style layout that fits (:func:`opsched.plan.layout_search.search_layouts`) as a baseline
    row, with ``--runtime R`` the fastest R can run (:func:`opsched.export.runtimes.refusal`); whether the search
    ran past its deadline, so that an empty list may only mean the time ran out).

    The model is imported again with one sequence per microbatch (Megatron's
    micro-batch size 1); its step is counted as the planner counts every
    candidate's (makespan + the whole gradient sync), so the rows compare like
    with like. Empty when no such layout fits. ``deadline``: the planner's;
    the search gets :data:`LAYOUT_SEARCH_SHARE` of the time left after the
    import (which has no clock to stop it: 40 s of DeepSeek-V3's at load 3,
    which would otherwise leave the search half its share), and past that the
    layouts not yet evaluated are skipped.
    """
    t0 = time.perf_counter()
    og = import_onnx(request.model, dims={**dims, "batch": 1}, capacity_factor=request.capacity_factor, strict_dims=True)
    bg = coarsen(og)
    if deadline is not None:
        deadline = time.monotonic() + LAYOUT_SEARCH_SHARE * max(0.0, deadline - time.monotonic())
    modes = RECOMPUTE_MODES if request.recompute == "auto" else (training.recompute,)

    def runs(e) -> bool:  # the runtime asked for can run the layout as plan.json would hold it
        if runtime_named(request.runtime) is None:
            return True
        row = layout_row(e, bg, cluster, t0)
        return refusal(request.runtime, row.schedule, layout_fields(row.contents, row.microbatch_size, training.zero,
                                                                 row.recompute, training.optimizer_state,
                                                                 training.tp_comm_overlap, training.attention,
                                                                 training.dtype, row.recompute_modules)) is None

    found = search_layouts(bg, cluster, training, LayoutSearch(
        global_batch=global_batch, tokens_per_sequence=int(og.graph.get("dims", {}).get("seq", 1)),
        memory_limit=limit, recompute=modes, zero=training.zero, accept=runs, fewer_devices=True, deadline=deadline,
        whole_sync=True))
    rows = []
    for e in found:
        rows.append(layout_row(e, bg, cluster, t0))
        log.info("baseline: the fastest Megatron-style layout that fits, %s with %s: step time %s",
                 rows[-1].layout, e.schedule_name, seconds_text(rows[-1].step_time))
    return rows, deadline is not None and time.monotonic() > deadline


def layout_row(e, bg, cluster, t0: float):
    """A Megatron-style layout's :class:`opsched.plan.layouts.Evaluation` as a baseline row: its schedule on the real
    devices, what each stage holds, one sequence per data-parallel replica, its own recomputation."""
    lay = e.layout
    m = metrics(e.schedule)
    # the modes' own names: experts folded over the replicas hold 1/ep of them each; context-parallel ranks
    # are named (tp2.cp2.dp2) so that plan.json and its exports carry cp
    dense = str(Mode(tp=lay.tp, dp=lay.dp, cp=lay.cp))
    expert = str(Mode(tp=lay.tp, dp=lay.dp // lay.ep, ep=lay.ep, cp=lay.cp))
    contents = {
        c: stage_contents([held_block(bg.nodes[b]["block"],
                                      expert if lay.ep > 1 and expert_count(bg.nodes[b]["block"]) else dense)
                           for b in blocks])
        for c, blocks in enumerate(e.chunks)
    }
    used = "" if lay.devices == cluster.devices else f", on {lay.devices} of the {cluster.devices} devices"
    return Baseline(
        method=f"megatron {e.schedule_name}", layout=f"{lay}, micro-batch 1{used}",
        schedule=on_real_devices(e.schedule, Layout(lay.devices, lay.pp)),
        makespan=m.makespan, step_time=e.planner_step, bubble_ratio=m.bubble_ratio,
        peak_memory_bytes=e.peak_memory_bytes, grad_sync=e.grad_sync, solve_seconds=time.perf_counter() - t0,
        contents=contents, microbatch_size=lay.dp, recompute=lay.recompute,  # one sequence per replica
        recompute_modules=lay.recomputed_modules,
    )


def microbatch_hint(result: PlanResult, training, global_batch: int | None) -> str | None:
    """A sentence when ``--global-batch`` was split into the default 16 microbatches (``global_batch`` given only
    then) and microbatches that large fit some of the planner's layouts nowhere: more, smaller microbatches let
    deeper pipelines fit and shorten their bubbles (the two-encoder Optimus model at 512 GPUs: 1.16x Megatron-LM's
    layout with 16 microbatches of 96 sequences, 1.29x with 96 of 16; docs/BENCHMARKS.md).

    >>> from types import SimpleNamespace as NS
    >>> tried = [NS(source="upper", status="no fit"), NS(source="upper", status="scheduled")]
    >>> microbatch_hint(NS(candidates=tried), NS(microbatches=16, microbatch_size=96), 1536)[:64]
    'the global batch is split into the default 16 microbatches of 96'
    >>> microbatch_hint(NS(candidates=tried), NS(microbatches=16, microbatch_size=96), None) is None
    True
    """
    upper = [c for c in result.candidates if c.source == "upper"]
    unfit = [c for c in upper if c.status == NO_FIT]
    size = training.microbatch_size
    if global_batch is None or size < 4 or not unfit:
        return None
    smaller = max(b for b in range(1, size // 4 + 1) if global_batch % b == 0)
    return (f"the global batch is split into the default {training.microbatches} microbatches of {size} sequences, "
            f"and {len(unfit)} of the {len(upper)} layouts tried fit no placement in memory with microbatches that "
            f"large: --micro-batch-size {smaller} ({plain(global_batch // smaller)} microbatches) lets deeper "
            "pipelines fit and shortens their bubbles, for more search time")


def dims_as_planned(dims: dict[str, int], result: PlanResult) -> dict[str, int]:
    """The import's ``dims`` with the batch the chosen plan's microbatches hold: a Megatron-style layout takes one
    sequence per data-parallel replica, whatever batch the model was imported at (plan.json's ``dims`` and
    ``microbatch_size`` then agree, and the exports read the same batch)."""
    if "batch" in dims and result.microbatch_size and dims["batch"] != result.microbatch_size:
        return {**dims, "batch": int(result.microbatch_size)}
    return dims


def micro_batch_warning(result: PlanResult, asked: int | None) -> str | None:
    """The sentence saying that the chosen plan's microbatches are not the ``--micro-batch-size`` asked for (a
    Megatron-style layout, searched at one sequence per replica, won), or None."""
    if asked is None or not result.microbatch_size or result.microbatch_size == asked:
        return None
    return (f"--micro-batch-size {asked}: the fastest plan, {result.source} on {result.layout}, takes "
            f"{plural(result.microbatch_size, 'sequence')} a microbatch (one per data-parallel replica), not {asked}; "
            f"report.md's candidates list the plans at {asked}")


def plan_warnings(result: PlanResult, cluster: Cluster) -> list[str]:
    """What a reader of the chosen plan must know about it: devices left idle, fewer nodes the time limit left
    unsearched."""
    out = []
    if result.idle_devices:
        idle = result.idle_devices
        every = result.on_every_device
        if every is None:
            why = ("no plan the search found gives every device work (report.md's candidates say, layout by "
                   "layout, what was slower, did not fit or was cut by the time limit)")
        else:
            slower = every.step_time / result.step_time - 1.0
            why = (f"it is faster that way: the fastest plan found that gives every device work, {every.source} "
                   f"on {every.layout}, takes {seconds_text(every.step_time)} per step, "
                   f"{plain(100 * slower, 3)} % longer")
        which = f"device {idle[0]} (1 of {cluster.devices}) holds" if len(idle) == 1 else \
            f"devices {ranges_text(idle)} ({len(idle)} of {cluster.devices}) hold"
        out.append(f"{which} no stage of this plan: {why}")
    if result.fewer_nodes_unsearched is not None:
        fewer = plain(result.fewer_nodes_unsearched)
        out.append(f"no plan was searched on {fewer} devices (the first nodes, the others idle): the time limit was "
                   f"spent first, so a run on {fewer} devices alone may find a faster plan than this one; a larger "
                   "--time-limit leaves that search time, and then adding devices never gives a slower plan")
    return out
