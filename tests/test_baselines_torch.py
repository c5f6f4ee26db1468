"""Multi-stage baselines against PyTorch's own schedules (skipped without torch).

``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops`` lists
each rank's compute actions for a named schedule; idle slots (None) are
dropped, overlapped pairs compared as (forward;backward). The visualiser is
not used for single-stage schedules (its mock stages give a wrong 1F1B).
"""

from __future__ import annotations

import logging

import pytest

torch_vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")

from opsched.baselines import baseline_order  # noqa: E402
from opsched.baselines.interleaved import device_actions, rounds  # noqa: E402
from opsched.schedule import Pair, chain_stage_graph  # noqa: E402


def torch_order(name, pp, microbatches, per_rank):
    logging.disable(logging.WARNING)  # InterleavedZeroBubble logs about bubbles it pads
    try:
        ops = torch_vis.get_schedule_ops(name, pp, microbatches, per_rank)
    finally:
        logging.disable(logging.NOTSET)
    return [[_torch_str(a) for a in rank if a is not None] for rank in ops]


def _torch_str(action):
    subs = getattr(action, "sub_actions", None)
    if subs:
        return "(" + ";".join(_torch_str(a) for a in subs) + ")"
    kind = getattr(action.computation_type, "value", action.computation_type)
    return f"{action.stage_index}{kind}{action.microbatch_index}"


def our_order(order, pp):
    return [[f"({a.first};{a.second})" if isinstance(a, Pair) else str(a) for a in order[r]] for r in range(pp)]


CASES = [(2, 4), (4, 4), (4, 8), (4, 12), (8, 8), (8, 16), (8, 24), (3, 6)]


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("pp,m", CASES + [(4, 6), (4, 10), (8, 3)])
def test_interleaved_1f1b_matches_torch(pp, m, chunks):
    sg = chain_stage_graph(pp * chunks, devices=pp, placement="interleaved")
    assert our_order(baseline_order("interleaved-1f1b", sg, m), pp) == torch_order("Interleaved1F1B", pp, m, chunks)


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("pp,m", CASES + [(4, 6), (8, 3)])
def test_interleaved_zero_bubble_matches_torch(pp, m, chunks):
    # zb-h1 is this order with one chunk per device (torch only lists >= 2 chunks)
    per_round = rounds(pp, m)[1]
    ours = {r: device_actions(r, pp, chunks, m, zero_bubble=True, per_round=per_round) for r in range(pp)}
    assert our_order(ours, pp) == torch_order("InterleavedZeroBubble", pp, m, chunks)


def test_zb_h1_is_the_one_chunk_interleaved_zero_bubble_order():
    sg = chain_stage_graph(4)
    ours = baseline_order("zb-h1", sg, 8)
    assert ours == {r: device_actions(r, 4, 1, 8, zero_bubble=True) for r in range(4)}


@pytest.mark.parametrize("pp,m", CASES + [(4, 1), (4, 5)])
def test_zb_v_matches_torch(pp, m):
    sg = chain_stage_graph(2 * pp, devices=pp, placement="v")
    assert our_order(baseline_order("zb-v", sg, m), pp) == torch_order("ZBVZeroBubble", pp, m, 2)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 12), (4, 16), (8, 16), (8, 20), (3, 7)])
def test_dualpipev_matches_torch(pp, m):
    sg = chain_stage_graph(2 * pp, devices=pp, placement="v")
    assert our_order(baseline_order("dualpipev", sg, m), pp) == torch_order("DualPipeV", pp, m, 2)
