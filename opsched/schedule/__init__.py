"""Pipeline schedules: the StageGraph, the action IR, the simulator, the validator, metrics.

Vocabulary (see ``docs/``; the plan file's fields are in docs/plan.schema.json):

* a **stage** runs on a device group; the **StageGraph** is a DAG of stages
  whose edges carry forward activations (and, backwards, their gradients);
* a **job** is (stage, microbatch, pass) with pass F, I, W or B (= I + W fused), a :class:`PassKind`;
* a **pair** is two jobs of stages on the same devices run overlapped
  (DualPipe's F&B), one action whose duration follows :func:`pair_duration`;
* an **order** gives each device its ordered list of actions; an action of a
  stage whose group has several devices appears in the list of each of them;
* the **simulator** turns an order into as-soon-as-possible timed events;
* the **validator** checks any timed schedule against the plan contract.

This module is the single simulator, validator and metric set every schedule
in opsched goes through, baselines and MIP plans alike.

>>> sg = chain_stage_graph(2, f=1, b=2, w=1)
>>> F, B = PassKind.F, PassKind.B
>>> order = {0: [Job(0, 0, F), Job(0, 0, B)], 1: [Job(1, 0, F), Job(1, 0, B)]}
>>> events = simulate(sg, order, microbatches=1)
>>> [(e.stage, str(e.pass_), e.start, e.end) for e in events]
[(0, 'F', 0.0, 1.0), (1, 'F', 1.0, 2.0), (1, 'B', 2.0, 4.0), (0, 'B', 4.0, 6.0)]
"""

from opsched.schedule.actions import INPUT_GRADIENT_PASSES, Action, Event, Job, Order, PAIRED_BACKWARDS, PASSES, Pair, PassKind, Schedule, _PASS_RANK, _order_from_schedule, _tie_break_key, cached_on, jobs_of, order_from_schedule, pair_duration  # noqa: F401
from opsched.schedule.graph import Edge, Stage, StageGraph, _check_stage, _topological_order  # noqa: F401
from opsched.schedule.simulate import _action_devices, _backward_of, _check_job, _checked_actions, _numbered, _ready_time, _resumed, backward_kinds, dependencies, forward_and_backward, simulate  # noqa: F401
from opsched.schedule.validate import ScheduleError, _check_complete, _check_dependencies, _check_events, _check_exclusive, _check_memory, _check_pairs, _device_intervals, _devices_text, _g, _memory_changes, _name, _raise, _tolerance, device_param_bytes, validate  # noqa: F401
from opsched.schedule.metrics import Metrics, _metrics, busy_time, memory_profile, metrics, param_copies, transferred_bytes, zb_bubble_rate  # noqa: F401
from opsched.schedule.placement import (PLACEMENTS, Placement, _per_stage, chain_stage_graph,  # noqa: F401
                                       interleaved_device, stage_placement, v_device, v_stages)
