"""Measured times -> StageGraph, and the fitted per-action overhead (no torch needed)."""

from __future__ import annotations

import pytest

from opsched.schedule import Job, simulate
from opsched.torchrun.calibrate import fit_overhead, merged_times, stage_graph_from_times

TIMES = {(0, "F"): 1.0, (0, "I"): 1.0, (0, "W"): 0.5, (0, "B"): 1.25,
         (1, "F"): 1.5, (1, "I"): 1.5, (1, "W"): 1.0, (1, "B"): 2.0}
SPLIT = {0: [Job(0, m, p) for m in range(2) for p in "F"] + [Job(0, m, p) for m in range(2) for p in "IW"],
         1: [Job(1, m, p) for m in range(2) for p in "FIW"]}
FUSED = {d: [Job(j.stage, j.microbatch, "B") if j.pass_ == "I" else j for j in acts if j.pass_ != "W"]
         for d, acts in SPLIT.items()}


def makespan(sg, order):
    return max(e.end for e in simulate(sg, order, 2))


def test_overhead_is_paid_once_per_action_and_measured_b_is_kept():
    sg = stage_graph_from_times(TIMES, {0: 0, 1: 1}, comm=0.1, overhead=0.2)
    assert sg.stages[0].duration("B") == pytest.approx(1.45)  # measured 1.25 + one overhead
    assert sg.stages[0].duration("I") + sg.stages[0].duration("W") == pytest.approx(1.9)  # two overheads
    without_b = {k: v for k, v in TIMES.items() if k != (1, "B")}
    assert "B" not in stage_graph_from_times(without_b, {0: 0, 1: 1}).stages[0].time  # all stages or none
    assert merged_times(TIMES, [[0, 1]])[(0, "B")] == 3.25


def test_fit_recovers_the_overhead_that_made_the_measurements():
    true = 0.3
    truth = stage_graph_from_times(TIMES, {0: 0, 1: 1}, comm=0.1, overhead=true)
    measured = [makespan(truth, SPLIT), makespan(truth, FUSED)]
    predict = lambda o: [makespan(stage_graph_from_times(TIMES, {0: 0, 1: 1}, comm=0.1, overhead=o), order)
                         for order in (SPLIT, FUSED)]
    assert fit_overhead(predict, measured, largest=2.0) == pytest.approx(true, abs=1e-6)
    # measurements already below the zero-overhead prediction: no overhead
    assert fit_overhead(predict, [0.5 * m for m in measured], largest=2.0) == 0.0
