"""Hand-written pipeline schedules: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, ZB-V, DualPipe, DualPipeV.

Each method lives in its own module, which states its placement and its order:

* ``PLACEMENT``: the placement's name, a key of
  :data:`opsched.schedule.placement.PLACEMENTS`;
* ``TORCH_SCHEDULE``: the torch.distributed.pipelining schedule class that
  runs its order (``get_schedule_class``'s name), or None; ``MEGATRON_RUNS``:
  whether Megatron-LM runs it itself (the exports read both);
* ``stages_per_device(devices, stages)``: how many logical stages per device
  it regroups a chain of ``stages`` stages into;
* ``devices_of(stage, devices)``: the devices logical stage ``stage`` runs
  on, a tuple (one device; DualPipe's two copies: two);
* ``place(sg, microbatches, comm)``: the same chain of logical stages
  re-placed that way on the same devices;
* ``order(sg, microbatches)``: the per-device action lists, on exactly that
  placement.

So a new placement is stated in the one module that uses it. A
method refuses with :class:`~opsched.errors.Unsupported` and a one-line
reason when the stage graph or the microbatch count does not meet its
preconditions. Orders never depend on the costs, so they take non-uniform
per-stage costs as they are; the simulator times them.

>>> from opsched.schedule import chain_stage_graph
>>> sched = run_baseline("1f1b", chain_stage_graph(4), 8)
>>> max(e.end for e in sched.events)   # (M + P - 1)(F + B) with F=1, B=2
33.0
"""

from __future__ import annotations

from types import ModuleType

from opsched.baselines import dualpipe, dualpipev, gpipe, interleaved, one_f_one_b, zb_h1, zb_h2, zb_v
from opsched.errors import OverMemory, Unsupported
from opsched.schedule import Order, Schedule, StageGraph, simulate

#: method name -> module, in the order tables list them
METHODS: dict[str, ModuleType] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zb-v": zb_v,
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
}
NAMES: list[str] = list(METHODS)



def method(name: str) -> ModuleType:
    """The module of a method; raises Unsupported (listing the names) for an unknown one."""
    try:
        return METHODS[name]
    except KeyError:
        raise Unsupported(f"unknown baseline {name!r}; choose from {', '.join(NAMES)}") from None


def placement_of(name: str) -> str:
    """The placement a method uses: a key of :data:`opsched.schedule.placement.PLACEMENTS`."""
    return method(name).PLACEMENT


def placed_stage_graph(
    name: str, sg: StageGraph, microbatches: int | None = None, comm: float | None = None
) -> StageGraph:
    """The chain ``sg`` re-placed the way method ``name`` needs, on ``sg.num_devices`` devices.

    Rules (see docs/baselines.md): GPipe, 1F1B, ZB-H1 and ZB-H2 put one stage
    per device (consecutive stages merged, or split, to D stages);
    interleaved 1F1B uses v = max(2, P // D) chunks per device, stage k on
    device k mod D; ZB-V and DualPipeV use 2D stages in a V; DualPipe uses
    two copies of a D-stage chain in opposite directions, each running half
    of ``microbatches`` (so it needs the microbatch count). ``comm`` is the
    transfer time of a new cross-device edge (default: the largest edge time
    of ``sg``). Raises Unsupported when the chain cannot be re-placed.
    """
    module = method(name)
    copies = len(module.devices_of(0, sg.num_devices)) if sg.num_devices else 1
    if microbatches is None and copies > 1:
        raise Unsupported(f"{name}'s placement splits the microbatches between its two copies: pass microbatches")
    try:
        return module.place(sg, microbatches or 0, comm)
    except Unsupported as exc:
        message = str(exc)
        raise Unsupported(message if message.startswith(name) else f"{name}: {message}") from None


def baseline_order(name: str, sg: StageGraph, microbatches: int) -> Order:
    """Method ``name``'s per-device action order on exactly ``sg``.

    Raises Unsupported with a one-line reason when ``sg``'s placement or the
    microbatch count does not fit the method (use :func:`placed_stage_graph`
    first to re-place a chain).
    """
    return method(name).order(sg, microbatches)


def baseline_orders(sg: StageGraph, microbatches: int) -> dict[str, Order]:
    """Every method's order that applies to ``sg`` as placed, sorted by name (the others refuse and are left out).

    The lower level takes these as warm starts (``opsched.lower.solve(...,
    warm_orders=...)``).

    >>> from opsched.schedule import chain_stage_graph
    >>> list(baseline_orders(chain_stage_graph(2), 4))
    ['1f1b', 'gpipe', 'zb-h1', 'zb-h2']
    """
    out: dict[str, Order] = {}
    for name in sorted(NAMES):
        try:
            out[name] = baseline_order(name, sg, microbatches)
        except Unsupported:
            continue
    return out


def run_baseline(
    name: str, sg: StageGraph, microbatches: int, memory_limit: float | None = None, comm: float | None = None
) -> Schedule:
    """Re-place ``sg`` for method ``name``, build its order and simulate it.

    The returned :class:`Schedule` carries the placed stage graph and
    ``name``. With ``memory_limit`` (bytes per device, parameters plus
    activations) a schedule whose peak goes over it raises Unsupported.
    """
    placed = placed_stage_graph(name, sg, microbatches, comm)
    order = baseline_order(name, placed, microbatches)
    events = simulate(placed, order, microbatches)
    schedule = Schedule(placed, microbatches, events, memory_limit=memory_limit, name=name)
    if memory_limit is not None:
        from opsched.schedule import metrics

        peak = max(metrics(schedule).peak_memory_bytes, default=0.0)
        if peak > memory_limit * (1 + 1e-9):
            raise OverMemory(name, peak, memory_limit)
    return schedule
