"""What ``opsched plan`` prints and writes about a plan: the one-screen summary (text or JSON), report.md and
the fields of plan.json beyond the schedule contract."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from opsched.cost.cluster import ZERO_LEVELS
from opsched.cost.blocks import Mode
from opsched.export.runtimes import RUNTIMES, layout_fields
from opsched.schedule.placement import is_chain
from opsched.schedule import Job, Pair, metrics, pair_duration
from opsched.units import bytes_text, column_size_unit, column_time_unit, plain, plural, seconds_text
from opsched.upper.layouts import describe_layout, layout_devices
from opsched.plan.search import GLOSSARY
from opsched.schedule.shape import pair_savings, schedule_shape, shape_fields, shape_lines
from opsched.upper.layouts import NOTATION

#: how report.md says what each --zero level shards over data-parallel replicas
def runtimes_fields(runtimes: dict[str, str | None]) -> dict:
    """plan.json's ``runtimes`` (those that can run the plan) and ``runtimes_refused`` (runtime -> why not).

    >>> runtimes_fields({"torch": None, "megatron": "Megatron-LM cannot run this plan: a V"})
    {'runtimes': ['torch'], 'runtimes_refused': {'megatron': 'Megatron-LM cannot run this plan: a V'}}
    """
    return {"runtimes": [r for r, why in runtimes.items() if why is None],
            "runtimes_refused": {r: why for r, why in runtimes.items() if why is not None}}


def plan_extra(model: str, cluster, training, result, warnings: list[str] | None = None,
               dims: dict[str, int] | None = None) -> dict:
    """The fields plan.json holds beyond the schedule contract (``warnings``: the import's assumptions and warnings;
    ``dims``: the model's symbolic dims as planned, e.g. batch and seq, which a framework's batch settings need)."""
    samples = training.microbatches * training.microbatch_size
    return {
        "model": str(model),
        "dims": {str(k): int(v) for k, v in (dims or {}).items()},
        "cluster": {
            "name": cluster.name,
            "devices": cluster.devices,
            "devices_per_node": cluster.devices_per_node,
            "memory_bytes": cluster.memory_bytes,
        },
        "layout": result.layout,
        "source": result.source,
        "step_time": result.step_time,
        "grad_sync_seconds": result.grad_sync,
        "throughput": samples / result.step_time if result.step_time > 0 else 0.0,
        **layout_fields(result.contents, result.microbatch_size, training.zero, result.recompute,
                        training.optimizer_state, training.tp_comm_overlap, training.attention, training.dtype,
                        result.recompute_modules or ()),
        "stage_blocks": {str(k): c.blocks for k, c in result.contents.items()},
        "baselines": [b.to_dict(samples) for b in result.baselines],
        "refused_baselines": [{"method": k, "reason": v} for k, v in result.refused_baselines.items()],
        "candidates": [c.to_dict() for c in result.candidates],
        "on_half_the_nodes": None if result.on_half_the_nodes is None else dataclasses.asdict(result.on_half_the_nodes),
        "as_a_chain_step_time": result.chain_step_time,
        "warnings": list(warnings or []),
        "metrics": dict(result.metrics),
    }


def report_text(model: str, cluster, training, limit: float, result, warnings: list[str] | None = None,
                runtimes: dict[str, str | None] | None = None) -> str:
    """report.md: the plan against every baseline, every candidate tried, the stages, and how to read it all.

    Times and memory sizes carry units chosen per magnitude (one unit per
    table column), all through :mod:`opsched.units`.
    """
    samples = training.microbatches * training.microbatch_size
    m = metrics(result.schedule)
    solve = result.metrics.get("solve_seconds")
    stages = len(result.schedule.stage_graph.stages)
    lines = [
        f"# opsched plan: {Path(model).name}",
        "",
        f"- cluster: {cluster.name}, {plural(cluster.devices, 'device')}, {cluster.devices_per_node} per node",
        f"- memory limit: {bytes_text(limit)} per device (parameters + gradients + optimizer state + activations)",
        f"- microbatches: {result.schedule.microbatches} of {plural(result.microbatch_size, 'sample')} each; "
        f"dtype {training.dtype}",
        f"- ZeRO {training.zero}: {ZERO_LEVELS[training.zero]}; optimizer states in {training.optimizer_state} "
        f"({plain(training.bytes_per_param)} bytes per parameter with weight and gradient); "
        f"activation recomputation: {result.recompute}" + (
            f" (by module, Megatron's --recompute-modules: {', '.join(result.recompute_modules)})"
            if result.recompute_modules else ""),
        "- tensor-parallel collectives: " + ("run under their GEMMs (Megatron's --tp-comm-overlap; torch and "
                                             "torchtitan do not)" if training.tp_comm_overlap else "exposed"),
        f"- attention: {training.attention}" + (" (the scores written to memory between its kernels)"
                                                if training.attention == "unfused" else " (one kernel)"),
        f"- chosen: {result.source} on layout {result.layout} ({describe_layout(result.layout)}), "
        f"{plural(stages, 'pipeline stage')}{stages_on(result)}",
        *(f"- {name}: {line}" for name, line in plan_shape_lines(result)),
        *([f"- context parallelism: {', '.join(context_modes(result))}: {context_words(training)}"] if context_modes(result)
          else []),
        f"- step time {seconds_text(result.step_time)} (makespan {seconds_text(m.makespan)} + gradient sync "
        f"{seconds_text(result.grad_sync)}), throughput {plain(samples / result.step_time)} samples/s",
        f"- upper MIP placed {plural(result.blocks, 'block')}; time spent: upper {seconds_text(result.seconds.get('upper', 0))}, "
        f"baselines {seconds_text(result.seconds.get('baselines', 0))}, lower {seconds_text(result.seconds.get('lower', 0))}",
        *half_the_nodes_lines(result, cluster),
    ]
    if runtimes:
        lines.append(f"- runtimes that can run it: {runtimes_line(runtimes)} (section Runtimes)")
    if warnings:
        lines += ["", "## Assumptions and warnings", "",
                  "What the import had to assume about the model; the plan is only as right as these are.", ""]
        lines += [f"- {w}" for w in warnings]
    lines += [
        "",
        "## Plan and baselines",
        "",
        "Step time = schedule makespan + the once-per-step gradient all-reduce. Baselines run on the best",
        "contiguous layer split of the same model (same cost model, same memory limit); see docs/cost-model.md.",
        "How to read a layout: at the end of this report.",
        "",
    ]
    lines += baselines_table(result, m, samples, solve)
    lines += (candidates_table(result) + stages_table(result)
              + runtimes_table(runtimes or {}, overlapped_pairs(result.schedule),
                                 not is_chain(result.schedule.stage_graph)))
    lines += ["", "## How to read this report", "", "```", NOTATION.rstrip(), "", GLOSSARY.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def baselines_table(result, m, samples: int, solve: float | None) -> list[str]:
    """report.md's table of the plan against every baseline, the speed-up and the refused baselines.

    Apart from :func:`report_text` so that the report reads as its sections; ``m`` is the plan's metrics,
    ``samples`` a step's and ``solve`` the lower MIP's seconds (or None).
    """
    time_unit = column_time_unit([result.step_time] + [b.step_time for b in result.baselines])
    peak = max(m.peak_memory_bytes, default=0.0)
    size_unit = column_size_unit([peak] + [b.peak_memory_bytes for b in result.baselines])
    cell = lambda v, unit: "-" if v is None else unit.number(v)  # noqa: E731
    lines = [
        f"| method | layout | step time ({time_unit.name}) | throughput (samples/s) | bubble ratio | "
        f"peak memory ({size_unit.name}) | solve (s) |",
        "|---|---|---|---|---|---|---|",
        f"| **opsched** ({result.source}) | {result.layout} | {time_unit.number(result.step_time)} | "
        f"{plain(samples / result.step_time)} | {m.bubble_ratio:.3f} | {size_unit.number(peak)} | "
        f"{'-' if solve is None else f'{solve:.1f}'} |",
    ]
    for b in result.baselines:
        lines.append(
            f"| {b.method} | {b.layout} | {time_unit.number(b.step_time)} | {plain(samples / b.step_time)} | "
            f"{b.bubble_ratio:.3f} | {cell(b.peak_memory_bytes, size_unit)} | {b.solve_seconds:.2f} |"
        )
    if result.baselines:
        best = result.baselines[0]
        lines += ["", f"Speed-up over the best baseline ({best.method}): {best.step_time / result.step_time:.3f}x"]
    else:
        lines += ["", "No hand-written baseline fits in this memory on any contiguous split."]
    if result.refused_baselines:
        lines += ["", "Baselines refused on every contiguous split (groups = pipeline depth tried), or left out because "
                  "the runtime asked for (--runtime) cannot run them:", ""]
        lines += [f"- {method}: {reason}" for method, reason in result.refused_baselines.items()]
    return lines


def context_words(training) -> str:
    """What the summary and report.md say of a plan whose modes split sequences (issue 45): with ``--global-batch``
    only a tensor-parallel degree the attention heads do not allow leaves a group no other split."""
    why = ("the attention heads allow no tensor-parallel degree that leaves every replica whole sequences"
           if training.whole_sequences else "--global-batch G keeps every replica's sequences whole")
    return f"sequences split over context-parallel ranks, their K/V ring costed; {why}"


def context_modes(result) -> list[str]:
    """The chosen plan's modes that split sequences over context-parallel ranks (``cpN``), in order."""
    modes = {m for contents in result.contents.values() for m in contents.modes}
    return sorted(m for m in modes if Mode.parse(m).cp > 1)


def runtimes_line(runtimes: dict[str, str | None]) -> str:
    """The runtimes that can run the plan, in a line.

    >>> runtimes_line({"torch": None, "megatron": "a V", "torchtitan": None})
    'torch, torchtitan; not megatron'
    >>> runtimes_line({"torch": "branches", "megatron": "branches"})
    'none'
    """
    can = [r for r, why in runtimes.items() if why is None]
    cannot = [r for r, why in runtimes.items() if why is not None]
    return (", ".join(can) or "none") + (f"; not {', '.join(cannot)}" if can and cannot else "")


def overlapped_pairs(schedule) -> int:
    """How many of the schedule's F&B pairs are shorter than their two passes (a runtime must overlap them):
    :func:`opsched.schedule.shape.pair_savings`'s count."""
    return pair_savings(schedule)[1]


#: report.md's word on who runs a branching plan (issue 44): the production runtimes cannot, `opsched run` can
DAG_RUNTIMES = ("The stage graph branches (a DAG). torch.distributed.pipelining's schedules, Megatron-LM and "
                "torchtitan cannot run it: each takes a chain of stages (a V at most), passing activations from "
                "stage k to stage k+1 only. `opsched run plan.json` runs it, on CPU processes with its own "
                "point-to-point executor (gloo send/recv along the stage graph's edges), to check its gradients "
                "against one process; that is a check, not a production runtime.")


def runtimes_table(runtimes: dict[str, str | None], overlapped: int = 0, branches: bool = False) -> list[str]:
    """The report's Runtimes section: each runtime, the export that writes its files, or why it cannot run the plan;
    for a branching plan, who can run it (:data:`DAG_RUNTIMES`)."""
    if not runtimes:
        return []
    lines = ["", "## Runtimes", "",
             "Whether `opsched export` writes each runtime's files for this plan (its own checks; docs/export.md).",
             "`opsched plan --runtime R` keeps only plans R can run.", "",
             "| runtime | can run it | export, or why not |", "|---|---|---|"]
    for runtime, why in runtimes.items():
        lines.append(f"| {runtime} | {'yes' if why is None else 'no'} | "
                     + (f"`opsched export plan.json {RUNTIMES[runtime].export_flags}` |" if why is None else f"{why} |"))
    if overlapped:
        lines += ["", f"The step time counts {overlapped} overlapped F&B pairs as shorter than their two passes: "
                  "a runtime that overlaps them (DualPipe's) runs the plan as planned; torch's runtime (and "
                  "torchtitan's) runs each `OVERLAP_F_B` as F then B, which takes longer. `opsched plan "
                  "--runtime torch` plans without counting on the overlap."]
    if branches:
        lines += ["", DAG_RUNTIMES]
    return lines


def candidates_table(result) -> list[str]:
    """The report's Candidates section: every layout tried and how far each got, times in one unit."""
    times = [v for c in result.candidates for v in (c.estimate, c.makespan, c.step_time, c.lower_bound)]
    unit = column_time_unit(times)
    t = lambda v: "-" if v is None else unit.number(v)  # noqa: E731
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [
        "",
        "## Candidates tried",
        "",
        f"| source | layout | status | estimate ({unit.name}) | upper | makespan ({unit.name}) | "
        f"step time ({unit.name}) | bubbles | lower bound ({unit.name}) | gap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result.candidates:
        lines.append(
            f"| {c.source} | {c.layout} | {c.status} | {t(c.estimate)} | {c.upper_status or '-'} | {t(c.makespan)} | "
            f"{t(c.step_time)} | {f(c.bubble_ratio)} | {t(c.lower_bound)} | {f(c.gap)} |"
        )
    return lines


def half_the_nodes_lines(result, cluster) -> list[str]:
    """report.md's line on the plan found on half the nodes (none on one node)."""
    half = result.on_half_the_nodes
    if half is None:
        return []
    return [f"- on half the nodes ({plain(half.devices)} of the {plain(cluster.devices)} devices, the others idle) "
            f"the search found {half.source} on layout {half.layout}, step time {seconds_text(half.step_time)} "
            f"(in {seconds_text(result.seconds.get('half the nodes', 0))}): "
            + ("this plan, the fastest found" if half.chosen else "offered, and slower than this plan")]


def own_pair(sg, sid: int) -> tuple[float, float]:
    """The overlapped pair of stage ``sid``'s F and B (two microbatches) and its gain, ``(F + B - pair) / min(F, B)``."""
    f, b = sg.stage(sid).duration("F"), sg.stage(sid).duration("B")
    pair = pair_duration(sg, Pair(Job(sid, 0, "F"), Job(sid, 1, "B")))
    return pair, (f + b - pair) / min(f, b) if min(f, b) > 0 else 0.0


def stages_table(result) -> list[str]:
    """The report's Stages section: every stage's devices, times, layers and parallel modes, for every plan."""
    sg = result.schedule.stage_graph
    stages = sg.stages
    unit = column_time_unit([s.time[p] for s in stages for p in ("F", "I", "W")])
    lines = ["", "## Stages", "",
             f"| stage | devices | F / I / W ({unit.name}) | F&B pair ({unit.name}) | overlap gain | layers | "
             "parallel modes |", "|---|---|---|---|---|---|---|"]
    for s in stages:
        t = s.time
        held = result.contents.get(s.id)
        copy = f" (copy of stage {s.copy_of})" if s.copy_of is not None else ""
        layers = (held.layers if held else "-") + copy
        modes = held.modes_text if held else "-"
        devices = f"{s.devices[0]}" if len(s.devices) == 1 else f"{s.devices[0]}-{s.devices[-1]}"
        pair, gain = own_pair(sg, s.id)
        lines.append(f"| {s.id} | {devices} | {' / '.join(unit.number(t[p]) for p in ('F', 'I', 'W'))} | "
                     f"{unit.number(pair)} | {gain:.2f} | {layers} | {modes} |")
    lines += ["", "F&B pair: the stage's forward of one microbatch and backward (B) of another run overlapped, timed "
              "from the passes' compute and communication operations (docs/cost-model.md, \"Overlap\"), for a "
              "runtime that overlaps them as DualPipe's does; overlap gain: the share of the shorter pass it hides, "
              "(F + B - pair) / min(F, B). With --runtime R a pair costs its two passes (torch runs OVERLAP_F_B "
              "as F then B): gain 0."]
    if not result.contents:
        lines += ["", "(this schedule regroups the model's split into its own stages, so which blocks each holds is not tracked)"]
    else:
        lines += ["", "Every block of each stage, with its mode, is in plan.json (`stage_contents`)."]
    return lines


def stages_on(result) -> str:
    """", on N of its M devices" when the stages hold fewer devices than the chosen layout spans (the upper MIP may
    leave slots empty: "3x1 interleaved v=2, 2 stages" both on one device), else ""."""
    spans = layout_devices(str(result.layout))
    used = len({d for s in result.schedule.stage_graph.stages for d in s.devices})
    return f", on {used} of its {spans} devices" if spans is not None and used < spans else ""


def plan_shape_lines(result) -> list[tuple[str, str]]:
    """:func:`~opsched.schedule.shape.shape_lines` of the chosen schedule, the branches line saying, for a plan
    whose stages form one chain, why: the search was told so, the model has no branches to run apart, or the
    fastest plan found with its branches side by side was slower (named, with its step time)."""
    lines = shape_lines(result.schedule)
    if schedule_shape(result.schedule).branches:
        return lines
    return [(name, line + branch_reason(result) if name == "branches" else line) for name, line in lines]


def branch_reason(result) -> str:
    """Why the chosen plan runs no branches side by side, in parentheses (see :func:`plan_shape_lines`).

    >>> from types import SimpleNamespace as NS
    >>> from opsched.plan.plan_records import OtherPlan
    >>> branch_reason(NS(branch_search="searched", step_time=0.1, side_by_side=OtherPlan("upper", "4x4 v v=2", 0.11)))
    ' (the fastest plan with branches side by side, upper on 4x4 v v=2, takes 110 ms: 1.100x this one)'
    """
    search = getattr(result, "branch_search", "no towers")
    if search == "off":
        return " (--branches off)"
    if search == "no towers":
        return " (the model has no parallel branches outside its experts)"
    other, fork = result.side_by_side, getattr(result, "fork_shares", None)
    weights = "" if fork is None else (f"; its heaviest fork has {fork[0]:.1%} of the model's work in one branch and "
                                       f"{fork[1]:.1%} in the next")
    if other is None:
        return f" (no plan found runs the model's branches side by side{weights})"
    return (f" (the fastest plan with branches side by side, {other.source} on {other.layout}, takes "
            f"{seconds_text(other.step_time)}: {other.step_time / result.step_time:.3f}x this one{weights})")


def summary_text(model: str, cluster, training, result, samples: int, out: Path, names: list[str],
                 warnings: list[str] | None = None, runtimes: dict[str, str | None] | None = None) -> str:
    """The one-screen summary printed at the end; its step time is the one the Gantt titles show."""
    m = metrics(result.schedule)
    stages = len(result.schedule.stage_graph.stages)
    lines = [
        f"opsched plan {Path(model).name} on {cluster.devices} x {cluster.name}, {plural(result.schedule.microbatches, 'microbatch', 'microbatches')}",
        f"  chosen      {result.source} on layout {result.layout}, {plural(stages, 'stage')}{stages_on(result)}",
        f"  step time   {seconds_text(result.step_time)} (makespan {seconds_text(m.makespan)} + gradient sync "
        f"{seconds_text(result.grad_sync)})   throughput {plain(samples / result.step_time)} samples/s",
        f"  bubbles     {m.bubble_ratio:.3f}   peak memory {bytes_text(max(m.peak_memory_bytes, default=0.0))} per device",
        *(f"  {name:<11} {line}" for name, line in plan_shape_lines(result)),
    ]
    gap = result.metrics.get("gap")
    if gap is not None:
        lines.append(f"  lower MIP   bound {seconds_text(result.metrics.get('lower_bound', 0))} on the makespan, "
                     f"gap {gap:.3f}")
    if result.baselines:
        best = result.baselines[0]
        lines.append(
            f"  vs best baseline {best.method} ({best.layout}): {seconds_text(best.step_time)} -> "
            f"{best.step_time / result.step_time:.3f}x"
        )
    if result.refused_baselines:
        lines.append(f"  refused     {', '.join(result.refused_baselines)} (reasons in report.md)")
    split = context_modes(result)
    if split:
        lines.append(f"  context     {', '.join(split)}: {context_words(training)}")
    if runtimes:
        lines.append(f"  runtimes    {runtimes_line(runtimes)}"
                     + (" (reasons in report.md)" if any(why for why in runtimes.values()) else ""))
    if warnings:
        lines.append(f"  import      {plural(len(warnings), 'note')} on what the plan assumes about the model "
                     "(in report.md and plan.json)")
    lines.append(f"  files       {out}/{', '.join(names)}")
    return "\n".join(lines)


def summary_dict(model: str, cluster, training, result, out: Path, names: list[str],
                 warnings: list[str] | None = None, runtimes: dict[str, str | None] | None = None) -> dict:
    """What ``--json`` prints: the summary's figures with plan.json's names and units (seconds, bytes)."""
    m = metrics(result.schedule)
    samples = training.microbatches * training.microbatch_size
    best = result.baselines[0] if result.baselines else None
    return {
        "model": str(model),
        "cluster": cluster.name,
        "devices": cluster.devices,
        "microbatches": result.schedule.microbatches,
        "microbatch_size": result.microbatch_size,
        "source": result.source,
        "layout": result.layout,
        "stages": len(result.schedule.stage_graph.stages),
        "step_time": result.step_time,
        "throughput": samples / result.step_time if result.step_time > 0 else 0.0,
        "bubble_ratio": m.bubble_ratio,
        "peak_memory_bytes": max(m.peak_memory_bytes, default=0.0),
        "lower_bound": result.metrics.get("lower_bound"),
        "gap": result.metrics.get("gap"),
        "best_baseline": None if best is None else {
            "method": best.method,
            "layout": best.layout,
            "step_time": best.step_time,
            "speedup": best.step_time / result.step_time if result.step_time > 0 else None,
        },
        "refused_baselines": dict(result.refused_baselines),
        **shape_fields(result.schedule),
        "branch_search": result.branch_search,
        "fastest_side_by_side": None if result.side_by_side is None else dataclasses.asdict(result.side_by_side),
        "heaviest_fork_shares": None if result.fork_shares is None else list(result.fork_shares),
        "on_half_the_nodes": None if result.on_half_the_nodes is None else dataclasses.asdict(result.on_half_the_nodes),
        "warnings": list(warnings or []),
        **runtimes_fields(runtimes or {}),
        "files": [str(out / name) for name in names],
    }
