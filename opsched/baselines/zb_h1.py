"""ZB-H1 (Zero Bubble, arXiv 2401.10241): 1F1B's memory, W passes fill the drain.

Backwards are split into I (input gradient, on the critical path) and W
(weight gradient, no dependants). Stage s warms up with min(P-1-s, M)
forwards like 1F1B, then alternates F and I; from its s-th I on, each I is
followed by the W of the oldest pending I, and the s W's held back run at
the end where 1F1B would idle. This is the interleaved Zero Bubble order with
one chunk per device (see :mod:`opsched.baselines.interleaved`).

Preconditions: a chain with stage k on device k, microbatches >= 1.
Activations: like 1F1B, at most P microbatches (part of each held until W).

>>> from opsched.schedule import chain_stage_graph
>>> [str(a) for a in order(chain_stage_graph(2), 3)[1]]
['1F0', '1I0', '1F1', '1I1', '1W0', '1F2', '1I2', '1W1', '1W2']
"""

from __future__ import annotations

from opsched.schedule import placement
from opsched.baselines.common import check_microbatches
from opsched.baselines.interleaved import device_actions
from opsched.schedule import Order, StageGraph

PLACEMENT = "chain"
#: the schedule class torch.distributed.pipelining runs this order as (get_schedule_class), None if none
TORCH_SCHEDULE = None
#: Megatron-LM runs this schedule itself (its own 1F1B, interleaved when a rank holds several chunks)
MEGATRON_RUNS = False
stages_per_device = placement.one_stage_per_device
devices_of = placement.chain_devices
place = placement.place_chain


def order(sg: StageGraph, microbatches: int) -> Order:
    """The ZB-H1 order on a chain with stage k on device k."""
    d = sg.num_devices
    placement.expect_placement(sg, d, devices_of, "zb-h1", "stage k on device k")
    check_microbatches("zb-h1", microbatches, 1)
    return {s: device_actions(s, d, 1, microbatches, zero_bubble=True, per_round=microbatches) for s in range(d)}
