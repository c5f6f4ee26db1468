"""What every Gantt writer draws: the bars of a timed schedule, their colours, the title and hover text.

The trace, picture and HTML writers (:mod:`opsched.export.gantt_trace`,
:mod:`opsched.export.gantt_image`, :mod:`opsched.export.gantt_html`) import
this module; :mod:`opsched.export.gantt` picks one of them by file suffix.
Keeping the shared rules here, below all of them, means no writer imports the
dispatcher that imports it.

>>> from opsched.schedule import chain_stage_graph, simulate, Schedule, Job
>>> sg = chain_stage_graph(2, devices=1, placement="interleaved")
>>> order = {0: [Job(0, 0, "F"), Job(1, 0, "F"), Job(1, 0, "B"), Job(0, 0, "B")]}
>>> bars = gantt_bars(Schedule(sg, 1, simulate(sg, order, 1)))
>>> [(b.device, b.start, b.end, b.label, b.chunk) for b in bars]
[(0, 0.0, 1.0, '0F0', 0), (0, 1.0, 2.0, '1F0', 1), (0, 2.0, 4.0, '1B0', 1), (0, 4.0, 6.0, '0B0', 0)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from opsched.schedule import PASSES, Event, Metrics, Schedule, metrics
from opsched.schedule.shape import schedule_shape, shape_title
from opsched.units import Unit, ranges_text, seconds_text, time_unit

#: base colour of each pass (colour-blind-safe palette)
PASS_COLOURS = {"F": "#3b75af", "I": "#ef8636", "W": "#519e3e", "B": "#c53a32"}
PASS_NAMES = {"F": "forward", "I": "backward (inputs)", "W": "backward (weights)", "B": "full backward"}


#: the colour of each device group, as the report's stage graph and the Gantt's row labels show it: ColorBrewer's
#: 12-class qualitative "Set3" (Cynthia Brewer, colorbrewer2.org), light enough for dark text; it repeats past 12
GROUP_COLOURS = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462",
                 "#b3de69", "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f")


def device_groups(schedule: Schedule) -> dict[tuple[int, ...], str]:
    """Each device group a stage runs on -> its colour, groups in the order of their stages' ids.

    >>> from opsched.schedule import chain_stage_graph
    >>> device_groups(Schedule(chain_stage_graph(4, devices=2, placement="v"), 1, []))
    {(0,): '#8dd3c7', (1,): '#ffffb3'}
    """
    groups: dict[tuple[int, ...], str] = {}
    for st in schedule.stage_graph.stages:
        if st.devices not in groups:
            groups[st.devices] = GROUP_COLOURS[len(groups) % len(GROUP_COLOURS)]
    return groups


@dataclass(frozen=True)
class Bar:
    """One occupied interval of one device: a job, or both halves of an overlapped pair.

    ``chunks[k]`` is the position of ``events[k]``'s stage among the stages
    the device hosts (0 for the first), so a second model chunk or DualPipe's
    reverse direction can be drawn in a lighter shade; ``chunk`` is the first's.
    """

    device: int
    start: float
    end: float
    events: tuple[Event, ...]
    chunks: tuple[int, ...]

    @property
    def chunk(self) -> int:
        return self.chunks[0]

    @property
    def label(self) -> str:
        return "+".join(f"{e.stage}{e.pass_}{e.microbatch}" for e in self.events)

    @property
    def is_pair(self) -> bool:
        return len(self.events) > 1


def gantt_bars(schedule: Schedule, devices: Iterable[int] | None = None) -> list[Bar]:
    """Every bar to draw, sorted by (device, start); a stage on a group gives one bar per device (per device of
    ``devices`` only, when given: the first of each row a chart draws)."""
    sg = schedule.stage_graph
    hosted = {d: sg.stages_on(d) for d in (range(sg.num_devices or 0) if devices is None else devices)}
    groups: dict[tuple, list[Event]] = {}
    for e in schedule.events:
        key = ("pair", e.pair) if e.pair is not None else ("job", e.stage, e.microbatch, e.pass_, e.start)
        groups.setdefault(key, []).append(e)
    bars = []
    for evs in groups.values():
        evs.sort(key=lambda e: (PASSES.index(e.pass_) != 0, e.stage, e.microbatch))  # F half first
        first = evs[0]
        for d in sg.stage(first.stage).devices:
            if d not in hosted:
                continue
            chunks = tuple(hosted[d].index(e.stage) if e.stage in hosted[d] else 0 for e in evs)
            bars.append(Bar(d, first.start, max(e.end for e in evs), tuple(evs), chunks))
    bars.sort(key=lambda b: (b.device, b.start, b.label))
    return bars


def device_rows(schedule: Schedule) -> list[tuple[int, ...]]:
    """The devices drawn as one row: runs of consecutive devices that host the same stages (so the same bars).

    A stage on a device group runs every job on all of its devices at once, so
    a plan on 1,024 devices in groups of 64 draws 16 rows, not 1,024.

    >>> from opsched.schedule import Stage, StageGraph, Edge
    >>> sg = StageGraph([Stage(0, (0, 1), {"F": 1, "I": 1, "W": 1}), Stage(1, (2,), {"F": 1, "I": 1, "W": 1})],
    ...                 [Edge(0, 1)], num_devices=4)
    >>> device_rows(Schedule(sg, 1, []))
    [(0, 1), (2,), (3,)]
    """
    sg = schedule.stage_graph
    rows: list[list[int]] = []
    last = None
    for d in range(sg.num_devices or 0):
        hosted = tuple(sg.stages_on(d))
        if rows and hosted == last:
            rows[-1].append(d)
        else:
            rows.append([d])
        last = hosted
    return [tuple(r) for r in rows]


def row_label(devices: tuple[int, ...]) -> str:
    """A row's name: ``device 3`` or ``devices 0-63``.

    >>> row_label((3,)), row_label((0, 1, 2))
    ('device 3', 'devices 0-2')
    """
    return ("device " if len(devices) == 1 else "devices ") + ranges_text(devices)


def lighten(hex_colour: str, amount: float) -> str:
    """Mix a ``#rrggbb`` colour with white; ``amount`` 0 keeps it, 1 gives white.

    >>> lighten("#000000", 0.5)
    '#808080'
    """
    rgb = [int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)]
    mixed = [round(c + (255 - c) * amount) for c in rgb]
    return "#" + "".join(f"{c:02x}" for c in mixed)


def bar_colour(pass_: str, chunk: int) -> str:
    """The colour of a pass on a device's ``chunk``-th stage: later chunks are lighter.

    >>> bar_colour("F", 0), bar_colour("F", 1)
    ('#3b75af', '#93b3d3')
    """
    return lighten(PASS_COLOURS[pass_], min(0.55, 0.45 * chunk))


def title_text(
    schedule: Schedule, title: str | None = None, m: Metrics | None = None, step_time: float | None = None
) -> str:
    """The figure title of every format, two lines: ``<title or method> — step time X, makespan Y, bubble ratio Z``,
    then the branches that run side by side and what the overlapped pairs save
    (:func:`opsched.schedule.shape.shape_title`, the words of the plan's summary).

    ``step_time`` (makespan + the gradient sync, what ``opsched plan``'s
    summary heads with) is shown when known; a schedule alone only knows its makespan.
    A format with room for one line joins them with ``; `` (:data:`TITLE_JOIN`).

    >>> from opsched.schedule import chain_stage_graph, simulate, Job
    >>> sg = chain_stage_graph(1, f=0.004, b=0.008, w=0.004)
    >>> s = Schedule(sg, 1, simulate(sg, {0: [Job(0, 0, "F"), Job(0, 0, "B")]}, 1), name="demo")
    >>> print(title_text(s, step_time=0.0125))
    demo — step time 12.5 ms, makespan 12 ms, bubble ratio 0.000
    one chain of stages; no overlapped F&B pair
    """
    m = m or metrics(schedule)
    head = title or schedule.name or "schedule"
    step = "" if step_time is None else f"step time {seconds_text(step_time)}, "
    return (f"{head} — {step}makespan {seconds_text(m.makespan)}, bubble ratio {m.bubble_ratio:.3f}\n"
            + shape_title(schedule_shape(schedule)))


#: how a one-line format (a trace's process name, a page's <title>) joins the title's two lines
TITLE_JOIN = "; "


def chart_time_unit(schedule: Schedule) -> Unit:
    """The time unit of a chart's axis and hover texts: the one its makespan reads best in."""
    return time_unit(schedule.makespan)


def job_description(e: Event, schedule: Schedule, unit: Unit | None = None) -> str:
    """A one-line hover text for an event, its times in ``unit`` (default: the chart's, :func:`chart_time_unit`).

    >>> from opsched.schedule import chain_stage_graph, simulate, Job
    >>> sg = chain_stage_graph(1, f=0.004, b=0.008, w=0.004)
    >>> s = Schedule(sg, 1, simulate(sg, {0: [Job(0, 0, "F"), Job(0, 0, "B")]}, 1))
    >>> job_description(s.events[1], s)
    'stage 0 (stage0), microbatch 0, full backward B: 4 ms to 12 ms (8 ms)'
    """
    unit = unit or chart_time_unit(schedule)
    st = schedule.stage_graph.stage(e.stage)
    name = f" ({st.name})" if st.name else ""
    pair = f", overlapped pair {e.pair}" if e.pair is not None else ""
    return (
        f"stage {e.stage}{name}, microbatch {e.microbatch}, {PASS_NAMES[e.pass_]} {e.pass_}: "
        f"{unit.text(e.start)} to {unit.text(e.end)} ({seconds_text(e.end - e.start)}){pair}"
    )


#: a digit of a label is about this share of the font size wide (sans-serif digits measure 0.55-0.6 em)
DIGIT_EM = 0.6
#: room kept around a label inside its bar, in pixels
LABEL_PAD_PX = 2.0


def label_font(text: str, bar_width_px: float, bar_height_px: float, sizes_px: tuple[float, ...]) -> float | None:
    """The largest of ``sizes_px`` (largest first) at which ``text`` fits inside a bar, or None when none does.

    Every timeline format labels a bar by this rule, the HTML page's zoom too
    (its script gets :data:`DIGIT_EM` and :data:`LABEL_PAD_PX` from here).

    >>> label_font("15", 13.7, 20, (10.4, 8.3)), label_font("15", 9, 20, (10.4, 8.3))
    (8.3, None)
    """
    for size in sizes_px:
        if DIGIT_EM * size * len(text) + LABEL_PAD_PX <= bar_width_px and size <= bar_height_px:
            return size
    return None
