"""The plans the report names besides the chosen one (:class:`~opsched.plan.plan_records.OtherPlan`): the
fastest that gives every device work when the chosen one leaves some idle, and the fastest whose branches run side
by side when the chosen one is a chain."""

from __future__ import annotations

from opsched.plan.plan_records import Option, OtherPlan
from opsched.schedule import StageGraph
from opsched.schedule.shape import schedule_shape

__all__ = ["idle_and_every_device_plan", "side_by_side_plan", "idle_devices"]


def idle_and_every_device_plan(best: Option, options: list[Option],
                               devices: int) -> tuple[tuple[int, ...], OtherPlan | None]:
    """The chosen plan's idle devices and, when there are some, the fastest option that keeps every device busy."""
    idle = idle_devices(best.schedule.stage_graph, devices)
    if not idle:
        return idle, None
    busy = [o for o in options if not idle_devices(o.schedule.stage_graph, devices)]
    every = min(busy, key=lambda o: o.step_time, default=None)
    return idle, None if every is None else OtherPlan(every.source, every.layout, every.step_time)


def side_by_side_plan(best: Option, options: list[Option]) -> OtherPlan | None:
    """When the chosen plan's stages form one chain: the fastest option whose branches run side by side, if any
    (the report says what the branches would have given)."""
    if schedule_shape(best.schedule).branches:
        return None
    apart = [o for o in options if schedule_shape(o.schedule).branches]
    fastest = min(apart, key=lambda o: o.step_time, default=None)
    return None if fastest is None else OtherPlan(fastest.source, fastest.layout, fastest.step_time)


def idle_devices(sg: StageGraph, devices: int) -> tuple[int, ...]:
    """The devices among ``0 .. devices-1`` that hold no stage of ``sg`` (they would do no work).

    >>> from opsched.schedule import chain_stage_graph
    >>> idle_devices(chain_stage_graph(2), 4)
    (2, 3)
    """
    held = {d for stage in sg.stages for d in stage.devices}
    return tuple(d for d in range(devices) if d not in held)
