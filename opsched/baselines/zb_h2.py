"""ZB-H2 (Zero Bubble, arXiv 2401.10241): more warm-up forwards, W's fill every gap.

ZB-H2 trades memory for bubbles: stage s may hold up to 2(P-1-s)+1
microbatches awaiting their I (stage 0: 2P-1, the paper's peak), so the
warm-up bubble fills with forwards, and W passes fill the drain.

The order is fixed (independent of the actual costs): it is read off a
unit-time list schedule with F = I = W = 1 in which, at each step, every
stage runs the first of

1. the I of its oldest microbatch whose I can run (critical path first);
2. its next forward, if it can run, fewer than 2(P-1-s)+1 of its
   microbatches await their I and fewer than 2P await their W (this second
   bound only caps the W backlog; it does not change the timing in the
   cases we measured);
3. the W of its oldest pending I;

and idles otherwise. Preconditions: a chain with stage k on device k,
microbatches >= 1.

>>> from opsched.schedule import chain_stage_graph
>>> [str(a) for a in order(chain_stage_graph(2), 3)[0]]
['0F0', '0F1', '0F2', '0I0', '0W0', '0I1', '0W1', '0I2', '0W2']
"""

from __future__ import annotations

from opsched.schedule import placement
from opsched.baselines.common import check_microbatches
from opsched.schedule import Job, Order, PassKind, StageGraph

PLACEMENT = "chain"
#: the schedule class torch.distributed.pipelining runs this order as (get_schedule_class), None if none
TORCH_SCHEDULE = None
#: Megatron-LM runs this schedule itself (its own 1F1B, interleaved when a rank holds several chunks)
MEGATRON_RUNS = False
stages_per_device = placement.one_stage_per_device
devices_of = placement.chain_devices
place = placement.place_chain


def in_flight_limit(stage: int, stages: int) -> int:
    """Microbatches stage ``stage`` may hold before their I: 2(P-1-s)+1."""
    return 2 * (stages - 1 - stage) + 1


def unit_time_orders(stages: int, microbatches: int) -> dict[int, list[Job]]:
    """The ZB-H2 action list of every stage (see the module docstring)."""
    done: dict[tuple[int, int, PassKind], int] = {}  # (stage, microbatch, pass) -> end step
    next_f = [0] * stages
    next_i = [0] * stages
    pending_w: list[list[int]] = [[] for _ in range(stages)]
    acts: dict[int, list[Job]] = {s: [] for s in range(stages)}
    remaining = 3 * stages * microbatches
    t = 0
    F, I, W = PassKind.F, PassKind.I, PassKind.W  # once: the loop tests them often, and a member lookup is slow on 3.11
    while remaining:
        step: list[tuple[int, int, PassKind]] = []
        for s in range(stages):
            i, f = next_i[s], next_f[s]

            def ended(key):  # finished by the start of step t
                return key in done and done[key] <= t

            i_ready = i < f and ended((s, i, F)) and (s == stages - 1 or ended((s + 1, i, I)))
            f_ready = (
                f < microbatches
                and (s == 0 or ended((s - 1, f, F)))
                and f - i < in_flight_limit(s, stages)
                and f - (i - len(pending_w[s])) < 2 * stages
            )
            if i_ready:
                step.append((s, i, I))
                next_i[s] += 1
                pending_w[s].append(i)
            elif f_ready:
                step.append((s, f, F))
                next_f[s] += 1
            elif pending_w[s]:
                step.append((s, pending_w[s].pop(0), W))
        for key in step:
            done[key] = t + 1
            acts[key[0]].append(Job(*key))
        remaining -= len(step)
        t += 1
    return acts


def order(sg: StageGraph, microbatches: int) -> Order:
    """The ZB-H2 order on a chain with stage k on device k."""
    d = sg.num_devices
    placement.expect_placement(sg, d, devices_of, "zb-h2", "stage k on device k")
    check_microbatches("zb-h2", microbatches, 1)
    return unit_time_orders(d, microbatches)
