"""Distributed runs on torch.distributed.pipelining (2 gloo ranks, tiny model, 2 steps, a timeout)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.pipelining")

from opsched.errors import OpschedError  # noqa: E402
from opsched.export.torch_csv import csv_text, read_torch_csv, stage_ranks, write_torch_csv  # noqa: E402
from opsched.schedule import chain_stage_graph  # noqa: E402
from opsched.torchrun.launch import RunJob, compare_with_reference, run_job, run_jobs_interleaved  # noqa: E402
from opsched.torchrun.model import ModelSpec, batch, build_stage_modules, reference_step  # noqa: E402

TINY = ModelSpec(dim=8, hidden=16, experts=4, top_k=2, heads=2, seq=4, blocks=(1, 1, 1, 1))


def test_model_split_does_not_change_the_model():
    """A 2-stage and a 4-stage split of the same spec compute the same loss and gradients."""
    x, y = batch(TINY, 4, step=0)
    four = reference_step(build_stage_modules(TINY), x, y, 2)
    two = reference_step(build_stage_modules(TINY.with_blocks((2, 2))), x, y, 2)
    assert four[0] == pytest.approx(two[0], rel=1e-12)
    assert len(four[1]) == len(two[1]) > 0


def test_reference_check_notices_a_wrong_gradient():
    """compare_with_reference must fail when one gradient is off (so a pass means something)."""
    from opsched.torchrun.launch import RankResult

    spec = TINY.with_blocks((1,))
    job = RunJob(spec, {0: 0}, microbatches=2, steps=1)
    modules = build_stage_modules(spec)
    x, y = batch(spec, 4, 0)
    losses, grads = reference_step(modules, x, y, 2)
    grads = {k: v.clone() for k, v in grads.items()}
    ok = compare_with_reference(job, [RankResult(0, [0], losses=[losses], grads=[grads])])
    assert ok["ok"], ok["problems"]
    name = sorted(grads)[0]
    grads[name] = grads[name] * (1 + 1e-6)
    bad = compare_with_reference(job, [RankResult(0, [0], losses=[losses], grads=[grads])])
    assert not bad["ok"] and name in bad["problems"][0]


@pytest.mark.slow
def test_exported_dualpipev_plan_and_torch_1f1b_run_and_match_reference(tmp_path):
    """An opsched order with overlapped pairs and split backwards, exported and run on 2 ranks."""
    vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    sg = chain_stage_graph(4, devices=2, placement="v")
    mb = 4
    # DualPipeV's order (pairs, I/W and B) as a hand-written file, read and re-exported by opsched
    ops = [[str(a) for a in row if a is not None] for row in vis.get_schedule_ops("DualPipeV", 2, mb, 2)]
    (tmp_path / "hand.csv").write_text(csv_text(ops))
    order = read_torch_csv(tmp_path / "hand.csv", sg, mb)
    assert any("OVERLAP" in str(a) for a in order[0])
    write_torch_csv(tmp_path / "plan.csv", sg=sg, order=order, microbatches=mb)
    job = RunJob(TINY, stage_ranks(sg), microbatches=mb, csv_path=str(tmp_path / "plan.csv"), steps=2)
    # torch's own Schedule1F1B on a 2-stage split runs in the same processes, step by step in turn
    builtin = RunJob(TINY.with_blocks((2, 2)), {0: 0, 1: 1}, microbatches=mb, schedule="1F1B", steps=2)
    results, builtin_results = run_jobs_interleaved([job, builtin], timeout=180)
    other = compare_with_reference(builtin, builtin_results)
    assert other["ok"], other["problems"][:5]
    report = compare_with_reference(job, results)
    assert report["ok"], report["problems"][:5]
    assert report["params"] == sum(len(r.grads[0]) for r in results)
    assert all(len(r.step_seconds) == 2 for r in results)
    # every stage's F, I and W were timed on the rank that hosts it
    timed = {key for r in results for key in r.compute_seconds}
    assert {(s, "F") for s in range(4)} <= timed


def test_bad_job_is_refused_before_starting_processes():
    with pytest.raises(OpschedError, match=r"without gaps; stage_ranks uses ranks \[0, 2\]"):
        run_job(RunJob(TINY.with_blocks((1, 1)), {0: 0, 1: 2}, microbatches=2, csv_path="x.csv"))
