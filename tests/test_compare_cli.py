"""`opsched compare`: table, --json, memory limits, refusals, -o output, bad flags, the MIP hook."""

from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import pytest

from opsched import lower
from opsched.baselines import NAMES, baseline_orders, run_baseline
from opsched.cli import main
from opsched.commands import compare as compare_cmd
from opsched.errors import Unsupported
from opsched.plan import compare as compare_run
from opsched.export.plan_json import read_plan
from opsched.schedule import chain_stage_graph, metrics, validate

solve_module = importlib.import_module("opsched.lower.solve")  # the package exports the function as solve
REAL_THIN_PAIRS = solve_module.thin_pairs


def run_cli(capsys, *argv):
    code = main(["compare", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    return {r["method"]: r for r in json.loads(out)}


@pytest.fixture(autouse=True)
def no_mip(monkeypatch):
    """The MIP row is refused here (tests/test_lower.py tests the solver), unless a test installs a fake one."""

    def refuse(*args, **kwargs):
        raise Unsupported("mip: not solved in these tests")

    monkeypatch.setattr(lower, "solve", refuse)
    # a fake solve's result has no order to thin; a test with the real solve installs the real thinning
    monkeypatch.setattr(solve_module, "thin_pairs", lambda sg, microbatches, result, **options: result)


def test_table_lists_every_method_with_figures_or_reason(capsys):
    code, out, err = run_cli(capsys, "--stages", "4", "--microbatches", "6")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "4 stages on 4 devices, 6 microbatches"
    assert lines[1].split()[:4] == ["method", "makespan", "bubble", "idle"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert list(rows) == [*NAMES, "mip"]
    # 1F1B at P=4, M=6, F=1, B=2: makespan (M+P-1)(F+B) = 27, idle 9 on each device
    assert rows["1f1b"].split()[1:4] == ["27", "0.3333", "9"]
    assert "refused: dualpipe needs" in rows["dualpipe"] and "microbatches=6" in rows["dualpipe"]
    assert "refused: dualpipev needs microbatches >= 8" in rows["dualpipev"]


def test_json_fields_agree_with_run_baseline(capsys):
    rows = run_json(capsys, "--stages", "4", "--microbatches", "8", "--f", "1,2,1,1", "--comm", "0.1")
    assert list(rows) == [*NAMES, "mip"]
    sg = chain_stage_graph(4, f=[1, 2, 1, 1], comm=0.1)
    for name in NAMES:
        row = rows[name]
        assert {"method", "makespan", "bubble_ratio", "peak_activation_bytes", "error"} <= set(row)
        m = metrics(run_baseline(name, sg, 8))
        assert row["error"] is None
        assert row["makespan"] == pytest.approx(m.makespan)
        assert row["bubble_ratio"] == pytest.approx(m.bubble_ratio)
        assert row["peak_activation_bytes"] == pytest.approx(max(m.peak_activation_bytes))
        assert row["idle"] == pytest.approx(m.idle)
    assert rows["dualpipe"]["param_copies"] == 2 and rows["1f1b"]["param_copies"] == 1


def test_refused_methods_are_listed_in_json_with_the_reason(capsys):
    rows = run_json(capsys, "--stages", "3", "--microbatches", "5")
    assert rows["dualpipe"]["error"].startswith("dualpipe needs an even number of stages")
    assert rows["dualpipe"]["makespan"] is None and rows["dualpipe"]["peak_activation_bytes"] is None
    assert rows["1f1b"]["error"] is None


def test_memory_limit_by_method_name_is_that_methods_peak(capsys):
    argv = ("--stages", "8", "--devices", "4", "--placement", "v", "--microbatches", "16")
    free = run_json(capsys, *argv)
    limited = run_json(capsys, *argv, "--memory-limit", "dualpipev")
    peak = free["dualpipev"]["peak_memory_bytes"]
    assert limited["dualpipev"]["error"] is None
    for name in NAMES:
        row = free[name]
        if row["peak_memory_bytes"] > peak:
            assert "over the memory limit" in limited[name]["error"]
        else:
            assert limited[name]["makespan"] == pytest.approx(row["makespan"])
    assert limited["gpipe"]["error"] is not None  # GPipe holds all 16 microbatches


def test_memory_limit_as_a_number_and_in_the_header(capsys):
    code, out, _ = run_cli(capsys, "--stages", "4", "--microbatches", "8", "--memory-limit", "4")
    assert code == 0
    assert out.splitlines()[0].endswith("memory limit 4")
    rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert "refused: gpipe needs 8 per device" in rows["gpipe"]
    assert "refused" not in rows["1f1b"]


def test_output_dir_has_a_valid_plan_and_pictures_per_method(tmp_path, capsys):
    out = tmp_path / "cmp"
    code, _, err = run_cli(
        capsys, "--stages", "4", "--microbatches", "8", "--methods", "1f1b,dualpipe,gpipe", "--memory-limit", "5",
        "-o", str(out),
    )
    assert code == 0, err
    for name in ("1f1b", "dualpipe"):
        schedule, doc = read_plan(out / name / "plan.json")
        validate(schedule)
        assert doc["method"] == name and doc["schema"] == "opsched.plan/1"
        for file in compare_cmd.GANTT_FILES:
            assert (out / name / file).stat().st_size > 0
        assert doc["memory_limit_bytes"] == 5
    assert not (out / "gpipe").exists()  # refused: it holds all 8 microbatches
    rows = json.loads((out / "compare.json").read_text())
    assert [r["method"] for r in rows] == ["1f1b", "dualpipe", "gpipe"]
    assert "over the memory limit 5" in rows[2]["error"]


def test_plan_input_compares_on_the_plans_stage_graph(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert run_cli(capsys, "--stages", "4", "--microbatches", "8", "--f", "1,2,3,4", "--methods", "1f1b", "-o", str(out))[0] == 0
    rows = run_json(capsys, "--plan", str(out / "1f1b" / "plan.json"), "--methods", "1f1b,zb-h1")
    direct = run_json(capsys, "--stages", "4", "--microbatches", "8", "--f", "1,2,3,4", "--methods", "1f1b,zb-h1")
    assert rows["zb-h1"]["makespan"] == pytest.approx(direct["zb-h1"]["makespan"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--stages", "x", "--microbatches", "4"], "--stages: expected a whole number"),
        (["--stages", "4", "--microbatches", "0"], "--microbatches: must be at least 1"),
        (["--stages", "4", "--microbatches", "4", "--f", "1,a"], "--f: expected a number"),
        (["--stages", "4", "--microbatches", "4", "--f", "1,2"], "expected 1 or 4 per-stage values"),
        (["--stages", "4", "--microbatches", "4", "--w", "3"], "exceeds the full backward"),
        (["--stages", "4", "--microbatches", "4", "--methods", "nope"], "--methods: unknown method nope"),
        (["--stages", "4", "--microbatches", "4", "--memory-limit", "lots"], "--memory-limit: give a number or a method"),
        (["--stages", "6", "--microbatches", "4", "--devices", "4"], "6 stages fit on 4 devices under no placement rule"),
        (["--stages", "4", "--microbatches", "4", "--placement", "diagonal"], "--placement: invalid choice: 'diagonal'"),
        (["--stages", "4", "--microbatches", "4", "--overlap-gain", "2"], "--overlap-gain: must be a finite number between 0 and 1"),
        (["--stages", "4", "--microbatches", "4", "--act", "1", "--act-w", "2"], "act_w"),
        (["--stages", "4", "--microbatches", "4", "--comm", "-1"], "--comm: must be a finite number >= 0"),
        (["--stages", "3", "--microbatches", "5", "--memory-limit", "dualpipe"], "--memory-limit dualpipe: dualpipe cannot run"),
        (["--microbatches", "4"], "give --stages P and --microbatches M"),
        (["--plan", "/nonexistent/plan.json"], "no such plan file"),
        (["--plan", "plan.json", "--stages", "4"], "--plan takes the stages from the plan; drop --stages"),
    ],
)
def test_bad_flags_give_one_line_and_exit_2(tmp_path, capsys, argv, message):
    out = tmp_path / "never"
    code, stdout, err = run_cli(capsys, *argv, "-o", str(out))
    assert code == 2
    assert stdout == ""
    assert err.count("\n") == 1 and err.startswith("opsched: error: ")
    assert message in err
    assert not out.exists()


def _fake_solve(calls: list):
    def fake_solve(sg, microbatches, options):
        memory_limit, time_limit, solver = options.memory_limit, options.time_limit, options.solver
        objective = str(options.objective)
        calls.append((len(sg.stages), microbatches, memory_limit, time_limit, solver, sorted(options.warm_orders),
                      objective))
        schedule = run_baseline("zb-h1", sg, microbatches)
        schedule.name = "mip"
        value = metrics(schedule).makespan if objective == "makespan" else 24.0
        return SimpleNamespace(schedule=schedule, lower_bound=20.0, gap=0.1, solver=solver, solve_seconds=0.5,
                               objective=objective, value=value, status="feasible", pairs_parted=0, cut_by="")

    return fake_solve


@pytest.fixture
def in_process(monkeypatch):
    """run_isolated as a direct call (the fake solve's calls stay visible); records each call's timeout."""
    from opsched.solving import isolate

    timeouts = []

    def direct(fn, *args, timeout, **kwargs):
        timeouts.append(timeout)
        return fn(*args, **kwargs)

    monkeypatch.setattr(isolate, "run_isolated", direct)
    return timeouts


def test_the_mip_searches_for_the_time_the_other_rows_left_and_keeps_its_row_place(capsys, monkeypatch, in_process):
    """--time-limit is the command's: a slow row listed after mip runs first and its time is the MIP's less."""
    calls = []
    monkeypatch.setattr(lower, "solve", _fake_solve(calls))
    real_run_method = compare_run.run_method
    clock = {"now": 1000.0}
    monkeypatch.setattr(compare_run.time, "monotonic", lambda: clock["now"])

    def slow_baselines(name, *args, **kwargs):
        if name != "mip":
            clock["now"] += 3.0  # each hand-written row takes 3 s of the command's 10
        return real_run_method(name, *args, **kwargs)

    monkeypatch.setattr(compare_run, "run_method", slow_baselines)
    code, stdout, err = run_cli(capsys, "--stages", "4", "--microbatches", "8", "--methods", "mip,1f1b,gpipe",
                                "--time-limit", "10", "--placement", "chain", "--quiet", "--json")
    assert code == 0, err
    assert [r["method"] for r in json.loads(stdout)] == ["mip", "1f1b", "gpipe"]
    (call,) = calls
    # 10 s less the two rows' 6 s, less the work after the search (checking 3 x 8 x 8 jobs: milliseconds)
    assert 3.9 < call[3] < 4.0


def test_mip_hook_adds_a_row_with_bound_and_gap(tmp_path, capsys, monkeypatch, in_process):
    calls = []
    monkeypatch.setattr(lower, "solve", _fake_solve(calls))
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(
        capsys, "--stages", "4", "--microbatches", "8", "--methods", "1f1b,mip", "--time-limit", "5",
        "--solver", "highs", "--quiet", "--json", "--placement", "chain", "-o", str(out),
    )
    assert code == 0, err
    rows = {r["method"]: r for r in json.loads(stdout)}
    assert rows["mip"]["lower_bound"] == 20.0 and rows["mip"]["gap"] == 0.1 and rows["mip"]["solver"] == "highs"
    # the baselines' orders on the chain as given are the MIP's warm starts
    (call,) = calls
    assert call[:3] + call[4:] == (4, 8, None, "highs", sorted(baseline_orders(chain_stage_graph(4), 8)), "makespan")
    # the command's 5 s, less the 1f1b row run before it and what checking and writing the files after it need
    assert 4.0 < call[3] < 5.0
    assert in_process == [3 * call[3] + 60]  # a hung solver is stopped after 3 x the time limit + 60 s
    assert rows["mip"]["objective"] == "makespan" and rows["mip"]["status"] == "feasible"
    code, table_out, _ = run_cli(capsys, "--stages", "4", "--microbatches", "8", "--methods", "mip", "--quiet",
                                 "--placement", "chain")
    assert code == 0
    assert table_out.splitlines()[2].endswith("chain, stage k on device k (4 stages); lower bound 20, gap 10.0%, cbc 0.5 s")
    _, doc = read_plan(out / "mip" / "plan.json")
    assert doc["metrics"]["lower_bound"] == 20.0 and doc["metrics"]["solve_seconds"] == 0.5


def test_branching_plan_gets_baselines_on_its_linearized_chain(tmp_path, capsys):
    from opsched.schedule.placement import linearize
    from opsched.export.plan_json import write_plan
    from opsched.schedule import Edge, Job, Schedule, Stage, StageGraph, simulate

    t = {"F": 1.0, "I": 1.0, "W": 1.0}
    sg = StageGraph([Stage(k, (k,), t) for k in range(3)], [Edge(0, 2, 0.5), Edge(1, 2, 0.5)], num_devices=3)
    order = {d: [Job(d, m, p) for m in range(4) for p in ("F", "I", "W")] for d in range(3)}
    order[2] = [Job(2, m, p) for m in range(4) for p in ("F", "I", "W")]
    write_plan(tmp_path / "plan.json", Schedule(sg, 4, simulate(sg, order, 4)))
    rows = run_json(capsys, "--plan", str(tmp_path / "plan.json"), "--methods", "1f1b,zb-h1")
    assert rows["1f1b"]["error"] is None and rows["1f1b"]["linearized"] is True
    assert rows["1f1b"]["makespan"] == pytest.approx(metrics(run_baseline("1f1b", linearize(sg), 4)).makespan)
    code, out, _ = run_cli(capsys, "--plan", str(tmp_path / "plan.json"), "--methods", "1f1b")
    assert code == 0 and "branches run one after another" in out


def test_plan_on_device_groups_gets_baselines_on_the_groups(tmp_path, capsys):
    """Stages on groups of two devices: the baselines run with each group as one device, then on its devices."""
    from opsched.export.plan_json import write_plan
    from opsched.schedule import Edge, Job, Schedule, Stage, StageGraph, simulate

    t = {"F": 1.0, "I": 1.0, "W": 1.0}
    sg = StageGraph([Stage(0, (2, 3), t), Stage(1, (0, 1), t)], [Edge(0, 1, 0.5)], num_devices=4)
    order = {d: [Job(s, m, p) for m in range(4) for p in ("F", "I", "W")] for s, devs in ((0, (2, 3)), (1, (0, 1)))
             for d in devs}
    write_plan(tmp_path / "plan.json", Schedule(sg, 4, simulate(sg, order, 4)))
    code, out, err = run_cli(capsys, "--plan", str(tmp_path / "plan.json"), "--methods", "1f1b", "-o", str(tmp_path / "out"))
    assert code == 0, err
    placed, _ = read_plan(tmp_path / "out" / "1f1b" / "plan.json")
    assert sorted(s.devices for s in placed.stage_graph.stages) == [(0, 1), (2, 3)]
    first = next(s for s in placed.stage_graph.stages if s.id == 0)
    assert first.devices == (2, 3)  # the chain starts on the group that ran the plan's first stage
    direct = run_baseline("1f1b", chain_stage_graph(2, f=1, b=2, w=1, comm=0.5), 4)
    assert metrics(placed).makespan == pytest.approx(metrics(direct).makespan)


def test_objective_reaches_the_mip_and_its_row(tmp_path, capsys, monkeypatch, in_process):
    calls = []
    monkeypatch.setattr(lower, "solve", _fake_solve(calls))
    out = tmp_path / "cmp"
    rows = run_json(capsys, "--stages", "4", "--microbatches", "8", "--methods", "mip", "--objective", "zb-span",
                    "--placement", "chain", "-o", str(out))
    assert [c[-1] for c in calls] == ["zb-span"]
    mip = rows["mip"]
    assert mip["objective"] == "zb-span" and mip["objective_value"] == 24.0 and mip["lower_bound"] == 20.0
    # in plan.json, lower_bound and gap stay on the makespan: the span's figures have their own names
    _, doc = read_plan(out / "mip" / "plan.json")
    assert "lower_bound" not in doc["metrics"]
    assert doc["metrics"]["objective"] == "zb-span" and doc["metrics"]["objective_lower_bound"] == 20.0
    code, table_out, _ = run_cli(capsys, "--stages", "4", "--microbatches", "8", "--methods", "mip",
                                 "--objective", "zb-span", "--quiet", "--placement", "chain")
    assert code == 0
    assert table_out.splitlines()[2].endswith("chain, stage k on device k (4 stages); zb-span 24, lower bound 20, gap 10.0%, cbc 0.5 s")
    code, _, err = run_cli(capsys, "--stages", "4", "--microbatches", "8", "--objective", "throughput")
    assert code == 2 and "--objective" in err


def test_zb_span_objective_end_to_end(capsys, monkeypatch):
    """The real solver on a small chain: the span's bound is below its value, and both are spans."""
    from opsched.lower.solve import solve as real_solve
    monkeypatch.setattr(lower, "solve", real_solve)
    rows = run_json(capsys, "--stages", "3", "--microbatches", "4", "--memory-limit", "3", "--methods", "mip",
                    "--objective", "zb-span", "--time-limit", "10", "--quiet", "--placement", "chain")
    mip = rows["mip"]
    assert mip["objective"] == "zb-span" and mip["lower_bound"] <= mip["objective_value"] + 1e-9
    assert mip["objective_value"] <= mip["makespan"] + 1e-9
    assert mip["gap"] == pytest.approx((mip["objective_value"] - mip["lower_bound"]) / mip["objective_value"])


def test_the_time_limit_holds_for_the_mip_row(capsys, monkeypatch):
    """The real solver on p=16, m=64 with a 1.5 s limit: the row is the best schedule by then, and says so."""
    import time

    from opsched.lower.solve import solve as real_solve
    monkeypatch.setattr(lower, "solve", real_solve)
    monkeypatch.setattr(solve_module, "thin_pairs", REAL_THIN_PAIRS)
    began = time.monotonic()
    rows = run_json(capsys, "--stages", "16", "--microbatches", "64", "--f", "18.522", "--b", "27.423", "--w", "9.337",
                    "--comm", "0.601", "--memory-limit", "16", "--methods", "zb-h1,mip", "--time-limit", "1.5",
                    "--quiet")
    took = time.monotonic() - began
    mip = rows["mip"]
    assert "status" in mip, mip
    assert mip["status"] == "time limit reached" and mip["solve_seconds"] <= 1.5 * 1.1 + 1.0
    assert took <= 1.5 * 1.1 + 6.0, took  # the zb-h1 row, the warm orders, validation: seconds on a loaded CI
    # the hand-written orders start the search: never worse than ZB-H1
    assert mip["makespan"] <= rows["zb-h1"]["makespan"] + 1e-9 and mip["lower_bound"] <= mip["makespan"]


def _crash(*args, **kwargs):
    """What CBC does under load: glibc's heap check message on the file descriptor, then a hang."""
    import os
    import time

    os.write(2, b"double free or corruption (out)\n")
    time.sleep(60)


def _hang(*args, **kwargs):
    import time

    time.sleep(30)


def test_a_solver_crash_costs_the_mip_row_not_the_command(capsys, monkeypatch):
    """A native abort in the isolated solve: the row says so, the baselines stay, exit 0 (no 60 s wait)."""
    monkeypatch.setattr(lower, "solve", _crash)
    code, out, err = run_cli(capsys, "--stages", "4", "--microbatches", "8", "--methods", "1f1b,mip", "--json",
                             "--quiet")
    assert code == 0, err
    rows = {r["method"]: r for r in json.loads(out)}
    assert rows["1f1b"]["makespan"] > 0
    assert rows["mip"]["makespan"] is None and rows["mip"]["error"] == "mip: the solver crashed (native abort)"


def test_a_hung_solver_is_stopped_after_its_timeout(capsys, monkeypatch):
    monkeypatch.setattr(lower, "solve", _hang)
    monkeypatch.setattr(compare_run, "solve_timeout", lambda limit: 0.5)
    code, out, _ = run_cli(capsys, "--stages", "2", "--microbatches", "2", "--methods", "1f1b,mip")
    assert code == 0 and "refused: mip: the solver did not return within" in out


def test_a_bug_in_the_isolated_solve_fails_compare_with_its_traceback(capsys, monkeypatch):
    def bug(*args, **kwargs):
        return {}["a bug in solve"]

    monkeypatch.setattr(lower, "solve", bug)
    with pytest.raises(KeyError) as exc:
        main(["compare", "--stages", "2", "--microbatches", "2", "--methods", "1f1b,mip", "--quiet"])
    assert "a bug in solve" in str(exc.value.__cause__)
    # and a crash while finding --memory-limit mip is a one-line error
    monkeypatch.setattr(lower, "solve", _crash)
    code, _, err = run_cli(capsys, "--stages", "2", "--microbatches", "2", "--methods", "1f1b",
                           "--memory-limit", "mip")
    assert code == 2 and err.count("\n") == 1 and "--memory-limit mip: the solver was lost" in err


def test_auto_placement_row_names_the_winner_and_every_placement_tried(capsys, monkeypatch, in_process):
    """A fake solve that runs each placement's first warm order: the row is the placement with the least makespan."""
    from opsched.lower import placements
    from opsched.schedule import Schedule, simulate

    def first_order_solve(sg, microbatches, options):
        solver, objective = options.solver, options.objective
        name, order = sorted(options.warm_orders.items())[0]
        schedule = Schedule(sg, microbatches, simulate(sg, order, microbatches), name="mip")
        value = metrics(schedule).makespan
        return SimpleNamespace(schedule=schedule, lower_bound=value - 1, gap=1 / value, solver=solver,
                               solve_seconds=0.25, objective=objective, value=value, status="feasible",
                               pairs_parted=0, cut_by="")

    monkeypatch.setattr(lower, "solve", first_order_solve)
    # every placement is solved here: none left out by its bound (test_placements covers that)
    monkeypatch.setattr(placements, "_prospects", lambda candidates, *_: [None] * len(candidates))
    rows = run_json(capsys, "--stages", "4", "--microbatches", "8", "--methods", "1f1b,dualpipe,dualpipev,mip")
    mip = rows["mip"]
    tried = {t["placement"]: t for t in mip["placements_tried"]}
    from opsched.plan.placements import SEARCHED

    assert list(tried) == list(SEARCHED)
    # chain: 1F1B's order first (sorted names); v: DualPipeV's; bidirectional: DualPipe's
    assert tried["chain"]["objective_value"] == rows["1f1b"]["makespan"]
    assert tried["v"]["objective_value"] == rows["dualpipev"]["makespan"]
    assert tried["bidirectional"]["objective_value"] == rows["dualpipe"]["makespan"]
    best = min(tried, key=lambda p: tried[p]["objective_value"])
    assert mip["placement_name"] == best and mip["makespan"] == tried[best]["objective_value"]
    assert mip["lower_bound"] == tried[best]["lower_bound"]  # the winner's bound, for its placement
    assert mip["lower_bound_all_placements"] == min(t["lower_bound"] for t in tried.values())
    assert mip["solve_seconds"] == len(SEARCHED) * 0.25
    code, out, _ = run_cli(capsys, "--stages", "4", "--microbatches", "8", "--methods", "mip")
    line = out.splitlines()[2]
    assert code == 0 and "; best of chain " in line and ", bidirectional " in line
    assert f"on this placement ({mip['lower_bound_all_placements']:.4g} over the {len(SEARCHED)} tried)" in line
