"""Interleaved 1F1B (Megatron): v chunks per device, stage k on device k mod D.

Microbatches go round in *rounds* of ``per_round`` microbatches: a device
runs the forwards of one round on its first chunk, then on its second, and
so on (depth first), and its backwards in the reverse chunk order. Device r
warms up with ``(v-1) * per_round + 2 (D-1-r)`` forwards (capped at v·M),
then alternates one forward and one fused backward, then drains.
``rounds = max(1, M // D)`` and ``per_round = M / rounds`` (PyTorch's
relaxation of Megatron's M % D == 0).

:func:`device_actions` with ``zero_bubble=True`` is the Zero Bubble variant
(PyTorch's InterleavedZeroBubble, ZB1P generalised to v chunks): the warm-up
shrinks to ``(v-1) * per_round + (D-1-r)``, backwards are split into I and W,
and device r runs the W of its oldest pending I after each I from its r-th
on, then all remaining W's at the end. With v = 1 that is ZB-H1.

Preconditions: a chain of v·D stages (v >= 2) with stage k on device k mod D;
M divisible by ``rounds``.

>>> from opsched.schedule import chain_stage_graph
>>> sg = chain_stage_graph(4, devices=2, placement="interleaved")
>>> [str(a) for a in order(sg, 2)[1]]
['1F0', '1F1', '3F0', '3B0', '3F1', '3B1', '1B0', '1B1']
"""

from __future__ import annotations

from opsched.schedule import placement
from opsched.baselines.common import Counters, check_microbatches
from opsched.errors import Unsupported
from opsched.schedule import Job, Order, PassKind, StageGraph

PLACEMENT = "interleaved"
#: the schedule class torch.distributed.pipelining runs this order as (get_schedule_class), None if none
TORCH_SCHEDULE = "Interleaved1F1B"
#: Megatron-LM runs this schedule itself (its own 1F1B, interleaved when a rank holds several chunks)
MEGATRON_RUNS = True


def stages_per_device(devices: int, stages: int) -> int:
    """Chunks per device (v) the re-placement of a chain of ``stages`` uses: P // D, at least 2."""
    return max(2, stages // devices)


def devices_of(stage: int, devices: int) -> tuple[int, ...]:
    """Stage k on device k mod D."""
    return (placement.interleaved_device(stage, devices),)


def place(sg: StageGraph, microbatches: int, comm: float | None = None) -> StageGraph:
    """The chain regrouped into v·D stages (v = max(2, P // D)), stage k on device k mod D."""
    return placement.placed_chain(sg, stages_per_device(sg.num_devices, len(sg.stages)), devices_of, comm)


def rounds(devices: int, microbatches: int) -> tuple[int, int]:
    """(number of rounds, microbatches per round); raises Unsupported if M is not a multiple of the rounds."""
    n = max(1, microbatches // devices)
    if microbatches % n:
        fit = devices * -(-microbatches // devices)  # a multiple of D always splits into M // D equal rounds
        raise Unsupported(
            f"interleaved schedules (torch's rule) run the {microbatches} microbatches in M // D = {n} equal rounds "
            f"on {devices} devices, and {microbatches} is not a multiple of {n}; use a multiple of {devices} "
            f"microbatches (e.g. {fit})"
        )
    return n, microbatches // n


def device_actions(
    rank: int, devices: int, chunks: int, microbatches: int, *, zero_bubble: bool = False, per_round: int | None = None
) -> list[Job]:
    """The action list of device ``rank`` (stage ids ``chunk * devices + rank``)."""
    if per_round is None:
        per_round = rounds(devices, microbatches)[1]
    factor = 1 if zero_bubble else 2
    total = chunks * microbatches
    warmup = min((chunks - 1) * per_round + factor * (devices - 1 - rank), total)
    backward = PassKind.I if zero_bubble else PassKind.B
    F, W = PassKind.F, PassKind.W  # once per device: a member lookup per job would cost a fifth of the order on 3.11
    count = Counters()

    def forward(j: int) -> Job:
        return count.job(((j // per_round) % chunks) * devices + rank, F)

    def backward_job(j: int) -> Job:
        return count.job((chunks - 1 - (j // per_round) % chunks) * devices + rank, backward)

    acts: list[Job] = [forward(j) for j in range(warmup)]
    pending_w: list[Job] = []
    for j in range(total):  # j-th backward; forwards ride along while some are left
        if warmup + j < total:
            acts.append(forward(warmup + j))
        b = backward_job(j)
        acts.append(b)
        if zero_bubble:
            pending_w.append(Job(b.stage, b.microbatch, W))
            if j >= rank:  # device r keeps r W's back to fill its drain bubbles
                acts.append(pending_w.pop(0))
    return acts + pending_w


def order(sg: StageGraph, microbatches: int) -> Order:
    """Interleaved 1F1B on a chain of v·D stages with stage k on device k mod D."""
    d = sg.num_devices
    p = len(sg.stages)
    if p % d or p // d < 2:
        raise Unsupported(
            f"interleaved-1f1b needs v >= 2 chunks per device: a multiple of {d} stages, at least {2 * d}; "
            f"got {p} (with one chunk it is 1f1b)"
        )
    placement.expect_placement(sg, p, devices_of, "interleaved-1f1b", "stage k on device k mod D")
    check_microbatches("interleaved-1f1b", microbatches, 1)
    _, per_round = rounds(d, microbatches)
    return {r: device_actions(r, d, p // d, microbatches, per_round=per_round) for r in range(d)}
