"""plan.json: schema fields, round trip, refusal of invalid schedules and malformed files."""

import json
from pathlib import Path

import jsonschema
import pytest

from opsched.errors import OpschedError
from opsched.export.plan_json import SCHEMA, plan_dict, read_plan, schedule_from_dict, write_plan
from opsched.schedule import Edge, Event, Job, Pair, PassKind, Schedule, ScheduleError, Stage, StageGraph, metrics, simulate


def dual_direction_schedule():
    """Two devices, two directions (stage 2 and 3 copy 1 and 0), a pair, a split backward."""
    t = {"F": 1.0, "I": 1.5, "W": 0.5}
    stages = [
        Stage(0, (0,), t, param_bytes=4.0, act_bytes=2.0, act_w_bytes=1.0, name="fwd0", microbatches=(0, 1)),
        Stage(1, (1,), t, param_bytes=4.0, act_bytes=2.0, act_w_bytes=1.0, name="fwd1", microbatches=(0, 1)),
        Stage(2, (1,), t, param_bytes=4.0, act_bytes=2.0, act_w_bytes=1.0, name="rev0", microbatches=(2, 3), copy_of=1),
        Stage(3, (0,), t, param_bytes=4.0, act_bytes=2.0, act_w_bytes=1.0, name="rev1", microbatches=(2, 3), copy_of=0),
    ]
    edges = [Edge(0, 1, time=0.25, bytes=8.0), Edge(2, 3, time=0.25, bytes=8.0)]
    sg = StageGraph(stages, edges, num_devices=2, overlap_gain=0.5)
    order = {
        0: [Job(0, 0, "F"), Job(0, 1, "F"), Job(3, 2, "F"), Pair(Job(3, 3, "F"), Job(3, 2, "B")), Job(3, 3, "B"),
            Job(0, 0, "I"), Job(0, 1, "B"), Job(0, 0, "W")],
        1: [Job(2, 2, "F"), Job(2, 3, "F"), Job(1, 0, "F"), Pair(Job(1, 1, "F"), Job(1, 0, "I")), Job(1, 1, "B"),
            Job(2, 2, "B"), Job(2, 3, "B"), Job(1, 0, "W")],
    }
    return Schedule(sg, 4, simulate(sg, order, 4), memory_limit=100.0, name="hand")


def test_plan_dict_has_the_contract_fields():
    sched = dual_direction_schedule()
    d = plan_dict(sched, extra={"lower_bound": 1.0, "metrics": {"solver": "cbc"}})
    assert d["schema"] == SCHEMA and d["time_unit"] == "s"
    assert d["devices"] == 2 and d["microbatches"] == 4 and d["memory_limit_bytes"] == 100.0
    st = d["stages"][3]
    assert st == {
        "id": 3, "devices": [0], "preds": [2], "time": {"F": 1.0, "I": 1.5, "W": 0.5}, "param_bytes": 4.0,
        "act_bytes": 2.0, "act_w_bytes": 1.0, "name": "rev1", "microbatches": [2, 3], "copy_of": 0,
    }
    assert d["edges"][0] == {"src": 0, "dst": 1, "time": 0.25, "bytes": 8.0}
    assert d["overlap_gain"] == 0.5 and d["method"] == "hand" and d["lower_bound"] == 1.0
    assert d["metrics"]["solver"] == "cbc"
    assert d["metrics"]["makespan"] == metrics(sched).makespan
    pairs = [e for e in d["schedule"]["events"] if "pair" in e]
    assert len(pairs) == 4 and {e["pass"] for e in pairs} == {"F", "B", "I"}


def test_round_trip(tmp_path):
    sched = dual_direction_schedule()
    path = tmp_path / "plan.json"
    doc = write_plan(path, sched, extra={"lower_bound": 2.0})
    back, raw = read_plan(path)
    assert raw == json.loads(path.read_text()) == doc
    assert back.events == sched.events and all(type(e.pass_) is PassKind for e in back.events)
    assert back.stage_graph.stages == sched.stage_graph.stages
    assert back.stage_graph.edges == sched.stage_graph.edges
    assert back.stage_graph.overlap_gain == 0.5 and back.stage_graph.num_devices == 2
    assert (back.microbatches, back.memory_limit, back.name) == (4, 100.0, "hand")
    assert metrics(back) == metrics(sched)
    # writing what was read gives the same bytes: deterministic output
    write_plan(tmp_path / "again.json", back, extra={"lower_bound": 2.0})
    assert (tmp_path / "again.json").read_text() == path.read_text()


def test_invalid_schedule_writes_nothing(tmp_path):
    sched = dual_direction_schedule()
    sched.memory_limit = 5.0  # below parameters + one activation on each device
    path = tmp_path / "plan.json"
    with pytest.raises(ScheduleError, match="memory limit 5"):
        write_plan(path, sched)
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_no_memory_limit_is_null(tmp_path):
    sched = dual_direction_schedule()
    sched.memory_limit = None
    write_plan(tmp_path / "p.json", sched)
    assert json.loads((tmp_path / "p.json").read_text())["memory_limit_bytes"] is None
    assert read_plan(tmp_path / "p.json")[0].memory_limit is None


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d.update(schema="other/2"), "field schema is 'other/2'"),
        (lambda d: d["stages"][1]["time"].pop("I"), r"stages\[1\].time.I must be a finite number"),
        (lambda d: d["schedule"]["events"][0].update({"pass": "X"}), r"schedule.events\[0\].pass is 'X'"),
        (lambda d: d["stages"][1].update(preds=[]), r"stages\[1\].preds is \[\] but the edges"),
        (lambda d: d["stages"][0].update(id=5), r"stages\[0\].id is 5"),
        (lambda d: d.update(devices="two"), "field devices must be an integer"),
        (lambda d: d["edges"][0].update(dst=9), "edge 0->9 names a stage that does not exist"),
        (lambda d: d.pop("schedule"), "field schedule must be an object"),
    ],
)
def test_malformed_plans_give_one_line(tmp_path, mutate, needle):
    d = plan_dict(dual_direction_schedule())
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(OpschedError, match=needle) as exc:
        read_plan(path)
    assert "\n" not in str(exc.value) and str(path) in str(exc.value)


def test_not_json_and_missing_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{ nope")
    with pytest.raises(OpschedError, match="not valid JSON"):
        read_plan(bad)
    with pytest.raises(OpschedError, match="no such plan file"):
        read_plan(tmp_path / "missing.json")


def test_events_one_per_line(tmp_path):
    sched = dual_direction_schedule()
    write_plan(tmp_path / "p.json", sched)
    lines = [ln for ln in (tmp_path / "p.json").read_text().splitlines() if '"pass"' in ln]
    assert len(lines) == len(sched.events)


def test_event_with_unknown_stage_is_refused_by_validate_not_reader(tmp_path):
    sched = dual_direction_schedule()
    d = plan_dict(sched)
    d["schedule"]["events"].append({"stage": 0, "microbatch": 3, "pass": "F", "start": 0.0, "end": 1.0})
    (tmp_path / "p.json").write_text(json.dumps(d))
    back, _ = read_plan(tmp_path / "p.json")
    from opsched.schedule import validate

    with pytest.raises(ScheduleError, match="does not run microbatch 3"):
        validate(back)
    assert isinstance(back.events[-1], Event)


def test_numpy_numbers_are_written_as_plain_json(tmp_path):
    np = pytest.importorskip("numpy")
    t = {"F": np.float64(1.0), "I": np.int64(1), "W": np.float32(0.5)}
    sg = StageGraph([Stage(0, (np.int64(0),), t, param_bytes=np.int64(3))])
    events = [Event(0, 0, "F", np.float64(0.0), np.float64(1.0)), Event(0, 0, "B", np.int64(1), np.float64(2.5))]
    sched = Schedule(sg, 1, events, memory_limit=np.int64(10))
    write_plan(tmp_path / "p.json", sched)
    back, doc = read_plan(tmp_path / "p.json")
    assert doc["memory_limit_bytes"] == 10.0 and doc["stages"][0]["devices"] == [0]
    assert back.events == events


def test_measured_fused_backward_round_trips(tmp_path):
    t = {"F": 1.0, "I": 1.5, "W": 0.5, "B": 1.75}
    sg = StageGraph([Stage(0, (0,), t), Stage(1, (1,), {"F": 1.0, "I": 1.5, "W": 0.5})], [Edge(0, 1)])
    order = {0: [Job(0, 0, "F"), Job(0, 0, "B")], 1: [Job(1, 0, "F"), Job(1, 0, "B")]}
    sched = Schedule(sg, 1, simulate(sg, order, 1))
    write_plan(tmp_path / "plan.json", sched)
    back, raw = read_plan(tmp_path / "plan.json")
    assert raw["stages"][0]["time"]["B"] == 1.75 and "B" not in raw["stages"][1]["time"]
    assert back.stage_graph.stages == sg.stages and back.events == sched.events


# --------------------------------------------------------------------------- docs/plan.schema.json

SCHEMA_FILE = Path(__file__).resolve().parent.parent / "docs" / "plan.schema.json"


def schema_errors(doc) -> list[str]:
    """Every place ``doc`` breaks docs/plan.schema.json (empty when it follows it)."""
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text()))
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(doc)]


def test_the_schema_file_is_a_valid_draft_2020_12_schema():
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["schema"]["const"] == SCHEMA


def test_written_plans_follow_the_schema(tmp_path):
    """A plan with every optional field (names, subsets, copies, pairs, a fused B), and a baseline's."""
    from opsched.baselines import run_baseline
    from opsched.schedule import chain_stage_graph

    fused = StageGraph([Stage(0, (0,), {"F": 1.0, "I": 1.5, "W": 0.5, "B": 1.75})])
    written = [
        write_plan(tmp_path / "hand.json", dual_direction_schedule(), extra={"metrics": {"lower_bound": 1.0, "gap": None}}),
        write_plan(tmp_path / "1f1b.json", run_baseline("1f1b", chain_stage_graph(4, comm=0.5), 8)),
        write_plan(tmp_path / "fused.json", Schedule(fused, 1, simulate(fused, {0: [Job(0, 0, "F"), Job(0, 0, "B")]}, 1))),
    ]
    for doc in written:
        assert schema_errors(doc) == []
    assert {"name", "microbatches", "copy_of"} <= set(written[0]["stages"][3]) and "B" in written[2]["stages"][0]["time"]
    assert any("pair" in e for e in written[0]["schedule"]["events"]) and "overlap_gain" in written[0]


def test_a_mip_plan_with_solver_figures_follows_the_schema(tmp_path):
    from opsched.lower import solve
    from opsched.schedule import chain_stage_graph

    result = solve(chain_stage_graph(2, f=1, b=2, w=1, overlap_gain=0.5), 4, allow_pairs=True, time_limit=5)
    figures = {"lower_bound": result.lower_bound, "gap": result.gap, "solver": result.solver,
               "solve_seconds": result.solve_seconds, "pairs_parted": result.pairs_parted}
    doc = write_plan(tmp_path / "mip.json", result.schedule, extra={"method": "mip", "metrics": figures})
    assert schema_errors(doc) == []
    assert schema_errors({**doc, "metrics": {**doc["metrics"], "pairs_parted": -1}}) != []
    assert any("pair" in e for e in doc["schedule"]["events"])  # the overlap gain makes pairs worth it


@pytest.mark.parametrize(
    "mutate, where",
    [
        (lambda d: d.pop("microbatches"), "$"),
        (lambda d: d.update(devices="two"), "$.devices"),
        (lambda d: d["stages"][1]["time"].pop("I"), "$.stages[1].time"),
        (lambda d: d["stages"][0].update(devices=[]), "$.stages[0].devices"),
        (lambda d: d["edges"][0].update(time=-1.0), "$.edges[0].time"),
        (lambda d: d["schedule"]["events"][0].update({"pass": "X"}), "$.schedule.events[0].pass"),
        (lambda d: d["schedule"]["events"][0].update(start="0"), "$.schedule.events[0].start"),
        (lambda d: d.update(schema="opsched.plan/2"), "$.schema"),
    ],
)
def test_broken_plans_break_the_schema_and_the_reader(mutate, where):
    """The schema and the reader's own checks refuse the same field errors."""
    doc = plan_dict(dual_direction_schedule())
    mutate(doc)
    errors = schema_errors(doc)
    assert errors and all(e.startswith(where) for e in errors), errors
    with pytest.raises(OpschedError):
        schedule_from_dict(doc)


def test_cross_field_rules_are_the_readers_not_the_schemas():
    """Stage ids, devices in range and preds against edges relate fields: code checks them, the schema cannot."""
    for mutate, needle in [
        (lambda d: d["stages"][0].update(id=5), r"stages\[0\].id is 5"),
        (lambda d: d["stages"][0].update(devices=[7]), "outside 0..1"),
        (lambda d: d["stages"][1].update(preds=[]), "preds is"),
    ]:
        doc = plan_dict(dual_direction_schedule())
        mutate(doc)
        assert schema_errors(doc) == []
        with pytest.raises(OpschedError, match=needle):
            schedule_from_dict(doc)


def test_refused_baselines_follow_the_schema():
    doc = plan_dict(dual_direction_schedule())
    doc["refused_baselines"] = [{"method": "dualpipe", "reason": "at 3 groups: dualpipe needs an even number"}]
    assert schema_errors(doc) == []
    doc["refused_baselines"] = [{"method": "dualpipe"}]
    assert schema_errors(doc) and schema_errors(doc)[0].startswith("$.refused_baselines[0]")


def test_warnings_follow_the_schema():
    doc = plan_dict(dual_direction_schedule())
    doc["warnings"] = ["MoE routing: 2 data-dependent expert selections sized by balanced routing"]
    assert schema_errors(doc) == []
    for bad in ("one string, not a list", [""], [3]):
        doc["warnings"] = bad
        assert schema_errors(doc) and schema_errors(doc)[0].startswith("$.warnings"), bad
