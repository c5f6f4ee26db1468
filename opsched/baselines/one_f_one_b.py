"""1F1B (PipeDream-flush): warm up, then alternate one forward and one backward.

Stage s of P warms up with min(P-s-1, M) forwards, then alternates a forward
and a fused backward (B) until its forwards run out, then drains its
backwards. Preconditions: a chain with stage k on device k, microbatches >= 1.
Activations: stage s holds at most min(P-s, M) microbatches.

>>> from opsched.schedule import chain_stage_graph
>>> [str(a) for a in order(chain_stage_graph(2), 3)[0]]
['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
"""

from __future__ import annotations

from opsched.schedule import placement
from opsched.baselines.common import check_microbatches
from opsched.schedule import Job, Order, PassKind, StageGraph

PLACEMENT = "chain"
#: the schedule class torch.distributed.pipelining runs this order as (get_schedule_class), None if none
TORCH_SCHEDULE = "1F1B"
#: Megatron-LM runs this schedule itself (its own 1F1B, interleaved when a rank holds several chunks)
MEGATRON_RUNS = True
stages_per_device = placement.one_stage_per_device
devices_of = placement.chain_devices
place = placement.place_chain


def stage_actions(stage: int, stages: int, microbatches: int, backward: PassKind = PassKind.B) -> list[Job]:
    """The 1F1B action list of one stage (``backward`` B, or I to leave W out)."""
    warmup = min(stages - stage - 1, microbatches)
    acts = [Job(stage, m, PassKind.F) for m in range(warmup)]
    for k in range(microbatches - warmup):
        acts += [Job(stage, warmup + k, PassKind.F), Job(stage, k, backward)]
    acts += [Job(stage, m, backward) for m in range(microbatches - warmup, microbatches)]
    return acts


def order(sg: StageGraph, microbatches: int) -> Order:
    """The 1F1B order on a chain with stage k on device k."""
    d = sg.num_devices
    placement.expect_placement(sg, d, devices_of, "1f1b", "stage k on device k")
    check_microbatches("1f1b", microbatches, 1)
    return {s: stage_actions(s, d, microbatches) for s in range(d)}
