"""DualPipeV: DualPipe "cut in half", two chunks per device in a V.

Device r of D holds chunk 0 = stage r and chunk 1 = stage 2D-1-r; every
microbatch runs down the V and back up. Each device runs DualPipe's eight
phases (:func:`eight_phases`) with ``n = D`` positions, position ``r`` and
M microbatches per chunk; the overlapped F&B pairs are :class:`~opsched.schedule.Pair`
actions timed by the stage graph's overlap rule (``pair_duration``).

Preconditions: 2D stages in the V placement, microbatches >= 2D.
Activations: at most D+1 microbatches of a chunk-pair per device.
"""

from __future__ import annotations

from opsched.schedule import placement
from opsched.baselines.common import Counters, check_microbatches
from opsched.baselines import zb_v
from opsched.schedule import Action, Job, Order, Pair, PassKind, StageGraph, v_stages

# ZB-V's placement: 2D stages in a V
PLACEMENT = zb_v.PLACEMENT
#: the schedule class torch.distributed.pipelining runs this order as (get_schedule_class), None if none
TORCH_SCHEDULE = "DualPipeV"
#: Megatron-LM runs this schedule itself (its own 1F1B, interleaved when a rank holds several chunks)
MEGATRON_RUNS = False
stages_per_device = zb_v.stages_per_device
devices_of = zb_v.devices_of
place = zb_v.place


def eight_phases(chunk0: int, chunk1: int, h: int, n: int, per_chunk: int, count: Counters) -> list[Action]:
    """DualPipe's per-device phases for a device at position ``h`` of ``n``.

    ``chunk0`` is the stage whose microbatches reach this device first,
    ``chunk1`` the other one; ``per_chunk`` microbatches pass each chunk.
    Phases (counts): 1. F0 x 2(n-h-1); 2. (F0, F1) x (h+1); 3. (I1, W, F1) x
    (n-h-1); 4. main loop (F0&B1, F1&B0) x (per_chunk - 2n + h + 1), where
    the device at the turn (h = n-1) runs its first F0 and B1 apart rather
    than paired, which lets the F start before the B is ready; 5. (B1,
    F1&B0) x (n-h-1); 6. (B1, B0) x (h+1), switching to split I from the
    middle of this phase on (chunk 1 first when h is odd); 7. (W, I0) x
    (n-h-1); 8. W x (h+1). A "W" takes the oldest pending I's weight pass
    (first in, first out); a backward is a fused B unless split.
    """
    acts: list[Action] = []
    weights: list[Job] = []

    def forward(stage):
        return count.job(stage, PassKind.F)

    def backward(stage, split=False):
        job = count.job(stage, PassKind.I if split else PassKind.B)
        if split:
            weights.append(Job(job.stage, job.microbatch, PassKind.W))
        return job

    def weight():
        if weights:
            acts.append(weights.pop(0))

    for _ in range(2 * (n - h - 1)):
        acts.append(forward(chunk0))
    for _ in range(h + 1):
        acts += [forward(chunk0), forward(chunk1)]
    for _ in range(n - h - 1):
        acts.append(backward(chunk1, split=True))
        weight()
        acts.append(forward(chunk1))
    for i in range(per_chunk - 2 * n + h + 1):
        if i == 0 and h == n - 1:
            acts += [forward(chunk0), backward(chunk1)]
        else:
            acts.append(Pair(forward(chunk0), backward(chunk1)))
        acts.append(Pair(forward(chunk1), backward(chunk0)))
    for _ in range(n - h - 1):
        acts.append(backward(chunk1))
        acts.append(Pair(forward(chunk1), backward(chunk0)))
    split = False
    for i in range(h + 1):
        if i == (h + 1) // 2 and h % 2 == 1:
            split = True
        acts.append(backward(chunk1, split))
        if i == (h + 1) // 2 and h % 2 == 0:
            split = True
        acts.append(backward(chunk0, split))
    for _ in range(n - h - 1):
        weight()
        acts.append(backward(chunk0, split=True))
    for _ in range(h + 1):
        weight()
    return acts


def order(sg: StageGraph, microbatches: int) -> Order:
    """The DualPipeV order on 2D stages in the V placement."""
    d = sg.num_devices
    placement.expect_placement(sg, 2 * d, devices_of, "dualpipev", zb_v.V_RULE)
    check_microbatches("dualpipev", microbatches, 2 * d, why=f"2 x {d} devices")
    return {r: eight_phases(*v_stages(r, d), r, d, microbatches, Counters()) for r in range(d)}
