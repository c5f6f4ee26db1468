"""ZB-V (Zero Bubble, arXiv 2401.10241 section 6): two chunks per device in a V.

Device r of D holds chunk 0 = stage r (on the way down) and chunk 1 = stage
2D-1-r (on the way back up), so the first and last stage share device 0.
Each device runs, in order (counts for device r):

1. warm-up: 2(D-r)-1 forwards of chunk 0;
2. r times: forward of chunk 1, forward of chunk 0;
3. D-r times: forward, I and W of chunk 1;
4. steady state until all forwards are done: (forward if any left), I and W
   of chunk 0, then forward, I and W of chunk 1;
5. cool-down: r times I of chunk 0 and I of chunk 1; D-r times I and W of
   chunk 0 (the W's of this phase go in I order per chunk);
6. the remaining W's of chunk 1, then of chunk 0.

Like PyTorch's ScheduleZBVZeroBubble, the counts are computed for
max(M, 2D-1) microbatches and the jobs of microbatches >= M are dropped, so
small M still gives a valid order. Zero bubble inside the steady state when
F = I = W; peak activations D·M_B per device's 2 chunks (the paper: p·M_B).

Preconditions: 2D stages in the V placement, microbatches >= 1.
"""

from __future__ import annotations

from opsched.schedule import placement
from opsched.baselines.common import Counters, check_microbatches
from opsched.schedule import Job, Order, PassKind, StageGraph, v_device, v_stages

PLACEMENT = "v"
#: the schedule class torch.distributed.pipelining runs this order as (get_schedule_class), None if none
TORCH_SCHEDULE = "ZBVZeroBubble"
#: Megatron-LM runs this schedule itself (its own 1F1B, interleaved when a rank holds several chunks)
MEGATRON_RUNS = False
#: what :func:`order` checks the stage graph against (DualPipeV shares it)
V_RULE = "2D stages in a V (device i holds stages i and 2D-1-i)"


def stages_per_device(devices: int, stages: int) -> int:
    """Two stages per device, whatever the input chain."""
    return 2


def devices_of(stage: int, devices: int) -> tuple[int, ...]:
    """The V: stage k on device :func:`~opsched.schedule.v_device` (k for k < D, else 2D-1-k)."""
    return (v_device(stage, devices),)


def place(sg: StageGraph, microbatches: int, comm: float | None = None) -> StageGraph:
    """The chain regrouped into 2D stages on D devices in a V."""
    return placement.placed_chain(sg, stages_per_device(sg.num_devices, len(sg.stages)), devices_of, comm)


def device_actions(rank: int, devices: int, microbatches: int) -> list[Job]:
    """The ZB-V action list of device ``rank``."""
    padded = max(microbatches, 2 * devices - 1)
    down, up = v_stages(rank, devices)
    c = Counters()
    acts: list[Job] = []
    fwd = {down: 0, up: 0}

    def f(stage):
        fwd[stage] += 1
        acts.append(c.job(stage, PassKind.F))

    def i_then_w(stage):
        acts.append(c.job(stage, PassKind.I))
        acts.append(c.job(stage, PassKind.W))

    for _ in range(2 * (devices - rank) - 1):
        f(down)
    for _ in range(rank):
        f(up)
        f(down)
    for _ in range(devices - rank):
        f(up)
        i_then_w(up)
    while fwd[up] < fwd[down] or fwd[down] < padded:
        if fwd[down] < padded:
            f(down)
        i_then_w(down)
        f(up)
        i_then_w(up)
    for _ in range(rank):
        acts.append(c.job(down, PassKind.I))
        acts.append(c.job(up, PassKind.I))
    for _ in range(devices - rank):
        acts.append(c.job(down, PassKind.I))
        acts.append(c.job(down, PassKind.W))
    for stage in (up, down):
        while c.next.get((stage, PassKind.W), 0) < padded:
            acts.append(c.job(stage, PassKind.W))
    return [a for a in acts if a.microbatch < microbatches]


def order(sg: StageGraph, microbatches: int) -> Order:
    """The ZB-V order on 2D stages in the V placement."""
    d = sg.num_devices
    placement.expect_placement(sg, 2 * d, devices_of, "zb-v", V_RULE)
    check_microbatches("zb-v", microbatches, 1)
    return {r: device_actions(r, d, microbatches) for r in range(d)}
