"""opsched.solving.isolate.run_isolated_all: several watched solves at once, each result its own call's."""

import faulthandler
import multiprocessing as mp
import os
import time

import pytest

from opsched.solving.isolate import Call, ChildTraceback, SolverCrash, TimedOut, run_isolated_all


def _square(x):
    return x * x


def _abort():
    os.write(2, b"double free or corruption (out)\n")
    faulthandler.disable()  # pytest's handler would print this process's stack (noise: the abort is the test)
    os.abort()


def _hang():
    time.sleep(600)


def _bug():
    return {}["a bug"]


def _interval(seconds):
    began = time.monotonic()
    time.sleep(seconds)
    return began, time.monotonic()


def test_results_come_back_in_call_order_and_skipped_calls_give_none():
    seen = []

    def call(k, running):
        seen.append((k, running))
        return None if k == 2 else Call(_square, (k,), timeout=30)

    assert run_isolated_all(call, 5, jobs=2) == [0, 1, None, 9, 16]
    assert [k for k, _ in seen] == [0, 1, 2, 3, 4]  # every call is asked for, in order
    assert all(0 <= running <= 1 for _, running in seen)  # never more in flight than a free worker allows
    assert seen[1] == (1, 1)  # the second worker starts while the first call runs


def test_each_result_is_heard_of_as_it_comes():
    heard = []
    got = run_isolated_all(lambda k, running: Call(_interval, (0.6 if k == 0 else 0.0,), timeout=30), 2, jobs=2,
                           on_result=lambda k, result: heard.append(k))
    assert heard == [1, 0]  # the quick second call is reported before the slow first one
    assert got[0][1] > got[1][1]  # and the results stay in call order


@pytest.mark.parametrize("jobs", [1, 3])
def test_a_crash_or_a_hang_costs_its_own_call_only(jobs):
    calls = [Call(_square, (3,), timeout=30), Call(_abort, timeout=30), Call(_hang, timeout=1.0),
             Call(_square, (4,), timeout=30)]
    got = run_isolated_all(lambda k, running: calls[k], len(calls), jobs=jobs)
    assert got[0] == 9 and got[3] == 16
    assert isinstance(got[1], SolverCrash) and "crashed" in str(got[1])
    assert isinstance(got[2], TimedOut)
    assert not mp.active_children()


def test_a_bug_stops_every_call_and_keeps_its_traceback():
    calls = [Call(_hang, timeout=60), Call(_bug, timeout=60)]
    with pytest.raises(KeyError) as bug:
        run_isolated_all(lambda k, running: calls[k], 2, jobs=2)
    assert isinstance(bug.value.__cause__, ChildTraceback) and "_bug" in bug.value.__cause__.text
    assert not mp.active_children()  # the hanging call was stopped with it


def test_two_workers_run_two_calls_at_once_and_one_runs_them_in_turn():
    def intervals(jobs):
        return run_isolated_all(lambda k, running: Call(_interval, (0.5,), timeout=30), 2, jobs=jobs)

    (a0, a1), (b0, b1) = intervals(2)
    assert b0 < a1 and a0 < b1  # overlapping
    (a0, a1), (b0, b1) = intervals(1)
    assert a1 <= b0  # one after the other


def test_jobs_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        run_isolated_all(lambda k, running: None, 1, jobs=0)
