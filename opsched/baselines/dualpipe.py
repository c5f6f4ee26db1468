"""DualPipe (DeepSeek-V3): two copies of the pipeline, fed from both ends.

With PP = D logical stages, device r holds logical stage r of the first copy
(direction 0: microbatches 0 .. M/2-1 enter at device 0) and logical stage
D-1-r of the second copy (direction 1: microbatches M/2 .. M-1 enter at
device D-1); see :func:`opsched.schedule.placement.dual_graph` for the stage
ids. Each device runs the eight phases of
:func:`opsched.baselines.dualpipev.eight_phases` with ``n = D/2`` positions,
position ``h = min(r, D-1-r)`` and M/2 microbatches per chunk; chunk 0 is the
direction that reaches the device first (direction 0 on devices 0..D/2-1,
direction 1 on the others).

Preconditions: PP = D even, microbatches even and >= 2·PP, both copies
placed as above. Parameters: 2 copies; activations: PP+1 microbatches of a
stage per device (the DualPipe README).
"""

from __future__ import annotations

from opsched.schedule import placement
from opsched.baselines.common import Counters
from opsched.baselines.dualpipev import eight_phases
from opsched.errors import Unsupported
from opsched.schedule import Order, StageGraph

PLACEMENT = "bidirectional"
#: the schedule class torch.distributed.pipelining runs this order as (get_schedule_class), None if none
TORCH_SCHEDULE = None
#: Megatron-LM runs this schedule itself (its own 1F1B, interleaved when a rank holds several chunks)
MEGATRON_RUNS = False
#: what :func:`order` checks the stage graph against
RULE = "two copies: stage r on device r and stage D+j (copy of j) on device D-1-j"


def stages_per_device(devices: int, stages: int) -> int:
    """One logical stage per device (each device then holds two copies: stages r and D-1-r)."""
    return 1


def devices_of(stage: int, devices: int) -> tuple[int, ...]:
    """Logical stage j's two copies: direction 0's on device j, direction 1's on device D-1-j."""
    return (stage, devices - 1 - stage)


def place(sg: StageGraph, microbatches: int, comm: float | None = None) -> StageGraph:
    """Two copies of the chain regrouped into D stages, in opposite directions."""
    check(sg.num_devices, microbatches)
    return placement.dual_graph(sg, microbatches, devices_of, comm)


def check(pp: int, microbatches: int) -> None:
    """Raise Unsupported unless PP is even and M is even and >= 2·PP."""
    if pp % 2 or microbatches % 2 or microbatches < 2 * pp:
        raise Unsupported(
            "dualpipe needs an even number of stages per direction and microbatches >= 2*PP and even; "
            f"got PP={pp}, microbatches={microbatches}"
        )


def order(sg: StageGraph, microbatches: int) -> Order:
    """The DualPipe order on the two-copy placement of :func:`place`."""
    d = sg.num_devices
    check(d, microbatches)
    place_ = [devices_of(j, d)[copy] for copy in (0, 1) for j in range(d)]
    placement.expect_single_devices(sg, "dualpipe")
    if len(sg.stages) != 2 * d or [s.devices[0] for s in sg.stages] != place_:
        raise Unsupported(f"dualpipe needs {RULE}; use baselines.placed_stage_graph")
    placement.expect_chain_edges(sg, list(range(d)), "dualpipe")
    placement.expect_chain_edges(sg, list(range(d, 2 * d)), "dualpipe")
    half = microbatches // 2
    down, up = tuple(range(half)), tuple(range(half, microbatches))
    for s in sg.stages:
        want = down if s.id < d else up
        if s.microbatches is None or tuple(sorted(s.microbatches)) != want:
            raise Unsupported(
                f"dualpipe: stage {s.id} must run microbatches {want[0]}..{want[-1]} (its direction's half); "
                "use baselines.placed_stage_graph with the same microbatch count"
            )
    ids = {s.id: (down if s.id < d else up) for s in sg.stages}
    out: Order = {}
    for r in range(d):
        first, second = r, d + (d - 1 - r)  # direction 0's and direction 1's stage on device r
        if r >= d // 2:
            first, second = second, first
        out[r] = eight_phases(first, second, min(r, d - 1 - r), d // 2, half, Counters(ids))
    return out
