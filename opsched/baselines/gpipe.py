"""GPipe: every forward, then every backward (fused B), one stage per device.

Preconditions: a chain with stage k on device k, microbatches >= 1.
Activations: a device holds every microbatch at the end of its forwards (M).

>>> from opsched.schedule import chain_stage_graph
>>> [str(a) for a in order(chain_stage_graph(2), 2)[1]]
['1F0', '1F1', '1B0', '1B1']
"""

from __future__ import annotations

from opsched.schedule import placement
from opsched.baselines.common import check_microbatches
from opsched.schedule import Job, Order, PassKind, StageGraph

PLACEMENT = "chain"
#: the schedule class torch.distributed.pipelining runs this order as (get_schedule_class), None if none
TORCH_SCHEDULE = "GPipe"
#: Megatron-LM runs this schedule itself (its own 1F1B, interleaved when a rank holds several chunks)
MEGATRON_RUNS = False
stages_per_device = placement.one_stage_per_device
devices_of = placement.chain_devices
place = placement.place_chain


def order(sg: StageGraph, microbatches: int) -> Order:
    """All forwards in microbatch order, then all backwards in microbatch order."""
    d = sg.num_devices
    placement.expect_placement(sg, d, devices_of, "gpipe", "stage k on device k")
    check_microbatches("gpipe", microbatches, 1)
    return {
        s: [Job(s, m, PassKind.F) for m in range(microbatches)] + [Job(s, m, PassKind.B) for m in range(microbatches)]
        for s in range(d)
    }
