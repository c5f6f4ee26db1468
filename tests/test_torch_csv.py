"""Tests of the torch pipelining CSV export and reader (opsched/export/torch_csv.py)."""

from __future__ import annotations

import json

import pytest

from helpers import hand_1f1b as one_f_one_b
from opsched import baselines as base
from opsched.cli import main
from opsched.errors import OpschedError
from opsched.export import torch_csv
from opsched.export.plan_json import write_plan
from opsched.export.torch_csv import (
    csv_text,
    order_from_schedule,
    read_torch_csv,
    torch_ranks,
    torch_rows,
    write_torch_csv,
)
from opsched.lower import solve
from opsched.schedule import Edge, Job, Pair, PassKind, Schedule, Stage, StageGraph, chain_stage_graph, simulate

J = Job


def deadlocking_order() -> dict:
    # rank 0 waits for 1B0 before sending 0F1; rank 1 starts with 1F1
    return {
        0: [J(0, 0, "F"), J(0, 0, "B"), J(0, 1, "F"), J(0, 1, "B")],
        1: [J(1, 1, "F"), J(1, 1, "B"), J(1, 0, "F"), J(1, 0, "B")],
    }


def torch_ops(name, pp, microbatches, per_rank=None):
    """Each rank's compute actions of a torch built-in schedule, as strings."""
    vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    rows = vis.get_schedule_ops(name, pp, microbatches, per_rank)
    keep = ("F", "I", "W", "B", "OVERLAP_F_B")
    return [[str(a) for a in row if a is not None and a.computation_type.value in keep] for row in rows]


# --------------------------------------------------------------------------- export


def test_hand_built_order_exports_in_order(tmp_path):
    sg = chain_stage_graph(3)
    order = one_f_one_b(3, 4)
    rows = write_torch_csv(tmp_path / "s.csv", sg=sg, order=order, microbatches=4, check_with_torch=False)
    assert rows[0] == ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"]
    assert rows[2] == ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"]
    assert (tmp_path / "s.csv").read_text().splitlines()[1] == ",".join(rows[1])


def test_hand_built_order_round_trips(tmp_path):
    sg = chain_stage_graph(3)
    order = one_f_one_b(3, 5)
    write_torch_csv(tmp_path / "s.csv", sg=sg, order=order, microbatches=5, check_with_torch=False)
    assert read_torch_csv(tmp_path / "s.csv", sg, 5) == order


def test_a_read_csv_holds_pass_kinds_and_writes_back_the_same_text(tmp_path):
    """Jobs read from a CSV carry PassKind members (equal to the plain letters of the order written), and the
    order read, written again, gives the same file: the members write as their letters."""
    sg = chain_stage_graph(3)
    write_torch_csv(tmp_path / "s.csv", sg=sg, order=base.zb_h1.order(sg, 6), microbatches=6, check_with_torch=False)
    back = read_torch_csv(tmp_path / "s.csv", sg, 6)
    assert {type(job.pass_) for acts in back.values() for job in acts} == {PassKind}
    write_torch_csv(tmp_path / "again.csv", sg=sg, order=back, microbatches=6, check_with_torch=False)
    assert (tmp_path / "again.csv").read_text() == (tmp_path / "s.csv").read_text()
    assert "PassKind" not in (tmp_path / "s.csv").read_text()


def test_schedule_events_give_the_device_order():
    sg = chain_stage_graph(4, devices=2, placement="v", f=1, b=2, w=1)
    order = {
        0: [J(0, 0, "F"), J(0, 1, "F"), J(3, 0, "F"), J(3, 0, "I"), J(3, 1, "F"), J(3, 1, "I"),
            J(0, 0, "I"), J(3, 0, "W"), J(0, 1, "I"), J(3, 1, "W"), J(0, 0, "W"), J(0, 1, "W")],
        1: [J(1, 0, "F"), J(2, 0, "F"), J(1, 1, "F"), J(2, 1, "F"), J(2, 0, "I"), J(1, 0, "I"),
            J(2, 1, "I"), J(1, 1, "I"), J(2, 0, "W"), J(1, 0, "W"), J(2, 1, "W"), J(1, 1, "W")],
    }
    schedule = Schedule(sg, 2, simulate(sg, order, 2))
    assert order_from_schedule(schedule) == order


def test_pair_events_become_one_pair_with_f_first():
    sg = chain_stage_graph(4, devices=2, placement="v", overlap_gain=0.5)
    pair = Pair(J(0, 1, "F"), J(3, 0, "B"))
    order = {
        0: [J(0, 0, "F"), J(3, 0, "F"), pair, J(3, 1, "F"), J(3, 1, "B"), J(0, 0, "B"), J(0, 1, "B")],
        1: [J(1, 0, "F"), J(2, 0, "F"), J(1, 1, "F"), J(2, 1, "F"), J(2, 0, "B"), J(1, 0, "B"),
            J(2, 1, "B"), J(1, 1, "B")],
    }
    schedule = Schedule(sg, 2, simulate(sg, order, 2))
    assert order_from_schedule(schedule)[0][2] == pair
    rows = torch_rows(sg, order_from_schedule(schedule), 2)
    assert rows[0][2] == "(0F1;3B0)OVERLAP_F_B"


def test_device_group_is_one_rank(tmp_path):
    stages = [
        Stage(0, (0, 1), {"F": 1, "I": 1, "W": 1}),
        Stage(1, (2,), {"F": 1, "I": 1, "W": 1}),
    ]
    sg = StageGraph(stages, [Edge(0, 1)])
    assert torch_ranks(sg) == [(0, 1), (2,)]
    order = {d: [J(0, 0, "F"), J(0, 0, "I"), J(0, 0, "W")] for d in (0, 1)}
    order[2] = [J(1, 0, "F"), J(1, 0, "I"), J(1, 0, "W")]
    rows = write_torch_csv(tmp_path / "g.csv", sg=sg, order=order, microbatches=1, check_with_torch=False)
    assert rows == [["0F0", "0I0", "0W0"], ["1F0", "1I0", "1W0"]]
    assert read_torch_csv(tmp_path / "g.csv", sg, 1) == order


def test_branching_graph_is_refused_with_the_reason(tmp_path):
    t = {"F": 1, "I": 1, "W": 1}
    sg = StageGraph([Stage(0, (0,), t), Stage(1, (1,), t), Stage(2, (2,), t)], [Edge(0, 1), Edge(0, 2)])
    order = {0: [J(0, 0, "F"), J(0, 0, "B")], 1: [J(1, 0, "F"), J(1, 0, "B")], 2: [J(2, 0, "F"), J(2, 0, "B")]}
    with pytest.raises(OpschedError, match=r"branches \(stage 0 feeds stages \[1, 2\]\).*only runs a chain"):
        write_torch_csv(tmp_path / "b.csv", sg=sg, order=order, microbatches=1)
    assert not list(tmp_path.iterdir())


def out_of_order_last_stage() -> dict:
    """A 2-stage order whose last stage runs microbatch 1's forward before microbatch 0's."""
    return {0: [J(0, 0, "F"), J(0, 1, "F"), J(0, 1, "B"), J(0, 0, "B")],
            1: [J(1, 1, "F"), J(1, 1, "B"), J(1, 0, "F"), J(1, 0, "B")]}


def test_microbatches_are_numbered_in_the_last_stage_forward_order(tmp_path):
    """torch's runtime reads microbatch m's loss at position m of the losses the last stage computed, in order:
    the export renumbers the microbatches (the same on every stage), and torch's loader accepts the file."""
    pytest.importorskip("torch")
    rows = write_torch_csv(tmp_path / "s.csv", sg=chain_stage_graph(2), order=out_of_order_last_stage(),
                           microbatches=2)
    assert rows == [["0F1", "0F0", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]


@pytest.mark.slow
def test_run_takes_a_plan_whose_last_stage_runs_microbatches_out_of_order(tmp_path, capsys):
    """Before the renumbering, torch stopped with 'Loss for microbatch 1 is not available'."""
    pytest.importorskip("torch.distributed.pipelining")
    sg = chain_stage_graph(2)
    schedule = Schedule(sg, 2, simulate(sg, out_of_order_last_stage(), 2))
    write_plan(tmp_path / "plan.json", schedule)
    assert main(["run", str(tmp_path / "plan.json"), "--steps", "1"]) == 0
    assert "parameter gradients match the single-process reference" in capsys.readouterr().out


def test_microbatch_subset_is_refused(tmp_path):
    t = {"F": 1, "I": 1, "W": 1}
    sg = StageGraph([Stage(0, (0,), t), Stage(1, (1,), t, microbatches=(0,))], [Edge(0, 1)])
    order = {0: [J(0, 0, "F"), J(0, 1, "F"), J(0, 0, "B"), J(0, 1, "B")], 1: [J(1, 0, "F"), J(1, 0, "B")]}
    with pytest.raises(OpschedError, match=r"stage 1 runs only microbatches \[0\].*DualPipe"):
        write_torch_csv(tmp_path / "m.csv", sg=sg, order=order, microbatches=2)


def test_overlapping_groups_are_refused():
    t = {"F": 1, "I": 1, "W": 1}
    sg = StageGraph([Stage(0, (0, 1), t), Stage(1, (1, 2), t)], [Edge(0, 1)])
    with pytest.raises(OpschedError, match="equal or disjoint"):
        torch_ranks(sg)


def test_deadlocking_plan_is_caught_before_export(tmp_path):
    sg = chain_stage_graph(2)
    with pytest.raises(OpschedError, match=r"would deadlock.*rank 0, action 2: '0B0' waits for 1B0"):
        write_torch_csv(tmp_path / "d.csv", sg=sg, order=deadlocking_order(), microbatches=2)
    assert not list(tmp_path.iterdir())


def test_incomplete_order_is_refused(tmp_path):
    sg = chain_stage_graph(2)
    order = one_f_one_b(2, 2)
    order[1] = order[1][:-1]
    with pytest.raises(OpschedError, match=r"stage 1 microbatch 1 has no B"):
        write_torch_csv(tmp_path / "i.csv", sg=sg, order=order, microbatches=2)


# --------------------------------------------------------------------------- reader errors


def _write(tmp_path, text):
    path = tmp_path / "schedule.csv"
    path.write_text(text)
    return path


def test_reader_names_row_and_cell_of_a_bad_action(tmp_path):
    path = _write(tmp_path, "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,,1X3\n")
    with pytest.raises(OpschedError) as err:
        read_torch_csv(path, chain_stage_graph(2), 2)
    assert str(err.value).startswith("schedule.csv row 2 (rank 1), cell 5: '1X3' is not an action; expected e.g. 1F3")


def test_reader_names_a_duplicate(tmp_path):
    path = _write(tmp_path, "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1,1F1\n")
    with pytest.raises(OpschedError, match=r"row 2 \(rank 1\), cell 5: '1F1' appears a second time"):
        read_torch_csv(path, chain_stage_graph(2), 2)


def test_reader_names_a_missing_action(tmp_path):
    path = _write(tmp_path, "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1I1\n")
    with pytest.raises(OpschedError, match=r"stage 1 microbatch 1 has no W: add 1W1 to row 2 \(rank 1\)"):
        read_torch_csv(path, chain_stage_graph(2), 2)


def test_reader_names_an_action_on_the_wrong_rank(tmp_path):
    path = _write(tmp_path, "0F0,0F1,0B0,0B1,1F0\n1B0,1F1,1B1\n")
    with pytest.raises(OpschedError, match=r"row 1 \(rank 0\), cell 5: '1F0' runs stage 1, which lives on rank 1"):
        read_torch_csv(path, chain_stage_graph(2), 2)


def test_reader_names_the_deadlocked_cells(tmp_path):
    path = _write(tmp_path, "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    with pytest.raises(OpschedError) as err:
        read_torch_csv(path, chain_stage_graph(2), 2)
    msg = str(err.value)
    assert "deadlocks" in msg
    assert "row 1 (rank 0), cell 2: '0B0' waits for 1B0" in msg
    assert "row 2 (rank 1), cell 1: '1F1' waits for 0F1" in msg


def test_reader_rejects_wrong_row_count(tmp_path):
    path = _write(tmp_path, "0F0,0B0\n")
    with pytest.raises(OpschedError, match="1 rows but the plan has 2 pipeline ranks"):
        read_torch_csv(path, chain_stage_graph(2), 1)


def test_reader_skips_comm_actions_and_idle_cells(tmp_path):
    text = "0F0,0SEND_F0,,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1,0REDUCE_GRAD\n" \
           "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n"
    order = read_torch_csv(_write(tmp_path, text), chain_stage_graph(2), 2)
    assert order == one_f_one_b(2, 2)


def test_reader_rejects_a_missing_file(tmp_path):
    with pytest.raises(OpschedError, match="no such schedule file"):
        read_torch_csv(tmp_path / "nope.csv", chain_stage_graph(2), 1)


def test_read_order_times_like_the_original(tmp_path):
    sg = chain_stage_graph(3, f=1, b=3, w=1)
    order = one_f_one_b(3, 6)
    write_torch_csv(tmp_path / "s.csv", sg=sg, order=order, microbatches=6, check_with_torch=False)
    again = read_torch_csv(tmp_path / "s.csv", sg, 6)
    assert simulate(sg, again, 6) == simulate(sg, order, 6)


# --------------------------------------------------------------------------- against torch

BUILTINS = [
    # name, ranks, microbatches, stages per rank, opsched placement
    ("GPipe", 2, 4, None, "chain"),
    ("Interleaved1F1B", 2, 4, 2, "interleaved"),
    ("Interleaved1F1B", 4, 8, 2, "interleaved"),
    ("InterleavedZeroBubble", 2, 4, 2, "interleaved"),
    ("ZBVZeroBubble", 2, 4, 2, "v"),
    ("ZBVZeroBubble", 4, 8, 2, "v"),
    ("DualPipeV", 2, 8, 2, "v"),
    ("DualPipeV", 4, 8, 2, "v"),
]


@pytest.mark.parametrize("name,pp,mb,per_rank,placement", BUILTINS)
def test_builtin_schedule_reads_and_exports_action_for_action(tmp_path, name, pp, mb, per_rank, placement):
    ops = torch_ops(name, pp, mb, per_rank)
    sg = chain_stage_graph(pp * (per_rank or 1), devices=pp, placement=placement)
    path = tmp_path / "torch.csv"
    path.write_text(csv_text(ops))
    order = read_torch_csv(path, sg, mb)
    out = write_torch_csv(tmp_path / "opsched.csv", sg=sg, order=order, microbatches=mb)
    assert out == ops
    runtime = torch_csv.load_with_torch(tmp_path / "opsched.csv", len(sg.stages), mb)
    assert [[str(a) for a in runtime.pipeline_order[r]] for r in range(pp)] == ops


def test_torch_1f1b_visualiser_order_is_off_by_one_on_the_last_rank(tmp_path):
    """torch's Schedule1F1B._get_pipeline_order numbers the last rank's forwards from 1.

    Its runtime loop is right; only the order it reports is not. opsched reads
    that dump and refuses it, naming the cell. (Deliberate difference, see docs/torch.md.)
    """
    ops = torch_ops("1F1B", 2, 4)
    path = tmp_path / "torch.csv"
    path.write_text(csv_text(ops))
    if "1F4" not in ops[1]:
        pytest.skip("this torch reports a correct 1F1B order")
    with pytest.raises(OpschedError, match=r"row 2 \(rank 1\), cell \d+: '1F4' names microbatch 4"):
        read_torch_csv(path, chain_stage_graph(2), 4)
    # rank 0's order is right, and opsched's hand-built 1F1B matches it
    assert [str(a) for a in one_f_one_b(2, 4)[0]] == ops[0]


def test_hand_built_1f1b_passes_torch_checks(tmp_path):
    pytest.importorskip("torch")
    sg = chain_stage_graph(4)
    write_torch_csv(tmp_path / "s.csv", sg=sg, order=one_f_one_b(4, 8), microbatches=8)
    runtime = torch_csv.load_with_torch(tmp_path / "s.csv", 4, 8)
    assert runtime.stage_index_to_group_rank == {0: 0, 1: 1, 2: 2, 3: 3}


def test_torch_rejects_what_opsched_rejects(tmp_path):
    """torch's own deadlock simulation agrees that the deadlocking order deadlocks."""
    pytest.importorskip("torch")
    path = _write(tmp_path, csv_text([[str(a) for a in row] for row in deadlocking_order().values()]))
    with pytest.raises(OpschedError, match="torch's pipeline runtime rejects"):
        torch_csv.check_with_torch_loader(path, 2, 2)


# --------------------------------------------------------------------------- baselines


GRAPHS = [("chain", 4, 4), ("v", 8, 4), ("interleaved", 8, 4)]


@pytest.mark.parametrize("placement,stages,devices", GRAPHS)
def test_every_baseline_round_trips(tmp_path, placement, stages, devices):
    sg = chain_stage_graph(stages, devices=devices, placement=placement, f=1, b=2, w=1)
    tried = 0
    for name in base.NAMES:
        try:
            placed = base.placed_stage_graph(name, sg, 8)
            order = base.baseline_order(name, placed, 8)
        except OpschedError:
            continue  # the baseline's preconditions do not hold on this graph
        try:
            torch_csv.check_expressible(placed, 8)
        except OpschedError as exc:
            assert "DualPipe" in str(exc) or "chain" in str(exc)
            continue
        path = tmp_path / f"{name}.csv"
        write_torch_csv(path, sg=placed, order=order, microbatches=8)
        again = read_torch_csv(path, placed, 8)
        assert simulate(placed, again, 8) == simulate(placed, order, 8), name
        tried += 1
    assert tried > 0


def torch_dump(name, pp, microbatches, per_rank, path):
    """torch's own ``_dump_csv`` (compute-only) of a built-in multi-stage schedule, as rows of strings.

    The schedule is built on stand-in stages, as torch's visualiser does; the
    single-stage classes (GPipe, 1F1B) have no ``_dump_csv``, so their
    ``pipeline_order`` is written with the same CSV writer.
    """
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = schedules.get_schedule_class(name)
    stages = torch_csv._mock_stages(pp * (per_rank or 1), pp, per_rank or 1)
    if issubclass(cls, schedules.PipelineScheduleSingle):
        order = cls(stages[0], microbatches).pipeline_order
        path.write_text(csv_text([["" if a is None else str(a) for a in order[r]] for r in range(pp)]))
    else:
        cls(stages, microbatches)._dump_csv(str(path), format="compute_only")
    import csv as _csv

    with open(path, newline="") as f:
        rows = list(_csv.reader(f))
    # keep compute actions (drop idle cells and torch's REDUCE_GRAD bookkeeping)
    return [[c for c in row if torch_csv.parse_cell(c) not in (None, "comm")] for row in rows]


SAME_AS_TORCH = [
    # opsched baseline, torch class, stages per rank, placement
    ("gpipe", "GPipe", None, "chain"),
    ("1f1b", "1F1B", None, "chain"),
    ("interleaved-1f1b", "Interleaved1F1B", 2, "interleaved"),
    ("zb-v", "ZBVZeroBubble", 2, "v"),
    ("dualpipev", "DualPipeV", 2, "v"),
]


@pytest.mark.parametrize("ours,theirs,per_rank,placement", SAME_AS_TORCH)
@pytest.mark.parametrize("pp,mb", [(2, 4), (4, 8), (4, 12)])
def test_baseline_export_equals_torch_dump(tmp_path, ours, theirs, per_rank, placement, pp, mb):
    sg = chain_stage_graph(pp * (per_rank or 1), devices=pp, placement=placement)
    placed = base.placed_stage_graph(ours, sg, mb)
    rows = write_torch_csv(tmp_path / "opsched.csv", sg=placed, order=base.baseline_order(ours, placed, mb),
                           microbatches=mb)
    theirs_rows = torch_dump(theirs, pp, mb, per_rank, tmp_path / "torch.csv")
    if theirs == "1F1B" and theirs_rows[-1] != rows[-1]:
        # torch's Schedule1F1B reports the last rank's forwards as microbatches 1..M
        # (its runtime loop runs 0..M-1); undo that shift, everything else must agree.
        fixed = [f"{pp - 1}F{int(c.split('F')[1]) - 1}" if "F" in c else c for c in theirs_rows[-1]]
        assert fixed == rows[-1]
        assert theirs_rows[:-1] == rows[:-1]
    else:
        assert rows == theirs_rows


# --------------------------------------------------------------------------- opsched compare --schedule


ZBV_2x4 = (
    "0F0,0F1,0F2,3F0,3I0,3W0,3F1,3I1,3W1,0F3,0I0,0W0,3F2,3I2,3W2,0I1,0W1,3F3,3I3,3W3,0I2,0W2,0I3,0W3\n"
    "1F0,2F0,1F1,2F1,2I0,2W0,1F2,1I0,1W0,2F2,2I1,2W1,1F3,1I1,1W1,2F3,2I2,2W2,1I2,2I3,1I3,1W2,2W3,1W3\n"
)


def test_compare_lists_a_hand_written_schedule(tmp_path, capsys):
    path = tmp_path / "mine.csv"
    path.write_text(ZBV_2x4)
    argv = ["compare", "--stages", "4", "--devices", "2", "--placement", "v", "--microbatches", "4",
            "--methods", "zb-v", "--schedule", str(path), "--json"]
    assert main(argv) == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    # the same order as opsched's ZB-V, so the same makespan from the same simulator
    assert rows["mine.csv"]["makespan"] == rows["zb-v"]["makespan"] == 25


def test_compare_rejects_a_bad_hand_written_schedule(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text(ZBV_2x4.replace("1W1,2F3", "1X1,2F3"))
    argv = ["compare", "--stages", "4", "--devices", "2", "--placement", "v", "--microbatches", "4",
            "--schedule", str(path)]
    assert main(argv) == 2
    assert "bad.csv row 2 (rank 1), cell 15: '1X1' is not an action" in capsys.readouterr().err


def test_export_command_writes_the_plan_csv(tmp_path, capsys):
    sg = chain_stage_graph(4, devices=2, placement="v")
    write_plan(tmp_path / "plan.json", base.run_baseline("zb-v", sg, 4))
    assert main(["export", str(tmp_path / "plan.json"), "--torch-csv", str(tmp_path / "s.csv")]) == 0
    assert (tmp_path / "s.csv").read_text() == ZBV_2x4
    assert "rank 0 = devices [0]" in capsys.readouterr().out


def test_export_command_refuses_bidirectional_dualpipe(tmp_path, capsys):
    write_plan(tmp_path / "plan.json", base.run_baseline("dualpipe", chain_stage_graph(2), 4))
    assert main(["export", str(tmp_path / "plan.json"), "--torch-csv", str(tmp_path / "s.csv")]) == 2
    assert "runs only microbatches" in capsys.readouterr().err
    assert not (tmp_path / "s.csv").exists()


@pytest.mark.parametrize("placement,stages,devices", [("chain", 2, 2), ("v", 4, 2)])
def test_mip_plan_round_trips_through_torch(tmp_path, placement, stages, devices):
    sg = chain_stage_graph(stages, devices=devices, placement=placement, f=1, b=2, w=1, comm=0.5)
    result = solve(sg, 4, time_limit=5)
    path = tmp_path / "mip.csv"
    rows = write_torch_csv(path, result.schedule)  # torch's loader and simulation run when torch is present
    again = read_torch_csv(path, result.schedule.stage_graph, 4)
    assert [[str(a) for a in again[d]] for d in sorted({s.devices[0] for s in sg.stages})] == rows
    resimulated = simulate(result.schedule.stage_graph, again, 4)
    assert max(e.end for e in resimulated) <= result.makespan + 1e-9
