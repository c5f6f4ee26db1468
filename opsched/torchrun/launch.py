"""Run a pipeline schedule on CPU processes with torch.distributed.pipelining.

:func:`run_job` starts one process per pipeline rank (gloo backend, a file
rendezvous, ``torch.set_num_threads(1)`` in each), builds the tiny MoE model of
:mod:`opsched.torchrun.model`, keeps each rank's stages, and runs a few
training steps of either an exported CSV (loaded into
``_PipelineScheduleRuntime`` with ``_load_csv(path, format="compute_only")``)
or one of torch's built-in schedule classes. Each rank reports its losses,
gradients, step times and per-stage F/I/W/B compute times;
:func:`compare_with_reference` checks the losses and every gradient against a
single-process run of the same model and data.

>>> job = RunJob(ModelSpec(blocks=(1, 1)), {0: 0, 1: 1}, microbatches=4,   # doctest: +SKIP
...              schedule="csv", csv_path="schedule.csv")
>>> results = run_job(job)                                                  # doctest: +SKIP
>>> compare_with_reference(job, results)["ok"]                              # doctest: +SKIP
True
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from opsched.errors import OpschedError
from opsched.torchrun.model import ModelSpec, sgd_update, unique_parameters

#: torch built-in schedules opsched can run for comparison, and their stages per rank
BUILTINS = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": 2,
    "InterleavedZeroBubble": 2,
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
}


@dataclass
class RunJob:
    """What every rank runs: the model, the stage -> rank map, the schedule, the steps.

    ``schedule`` is ``"csv"`` (then ``csv_path`` names a compute-only CSV) or
    a key of :data:`BUILTINS`. The first ``warmup`` steps are run but not timed.
    """

    spec: ModelSpec  # or opsched.torchrun.hf_model.HfModelSpec: the same methods
    stage_ranks: dict[int, int]
    microbatches: int
    schedule: str = "csv"
    csv_path: str | None = None
    microbatch_size: int = 2
    steps: int = 2
    warmup: int = 0
    lr: float = 0.05
    record_grads: bool = True
    measure_comm: bool = False

    @property
    def world_size(self) -> int:
        return 1 + max(self.stage_ranks.values())


@dataclass
class RankResult:
    """What one rank reports back (plain data, saved with ``torch.save``)."""

    rank: int
    stages: list[int]
    losses: list[list[float]] = field(default_factory=list)  # per step, per microbatch (last stage only)
    grads: list[dict] = field(default_factory=list)  # per step: "stage.param" -> tensor
    step_seconds: list[float] = field(default_factory=list)  # timed steps only
    compute_seconds: dict = field(default_factory=dict)  # (stage, pass) -> list of durations
    comm_seconds: float | None = None  # one-way latency of an activation-sized message
    busy_seconds: list[float] = field(default_factory=list)  # per timed step: compute time on this rank


# --------------------------------------------------------------------------- worker


def _timed(stage, method: str, kind, store, enabled) -> None:
    """Wrap ``stage.method`` to add its wall time to ``store[(stage index, kind(args))]``."""
    original = getattr(stage, method)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        if enabled[0]:
            store[(stage.stage_index, kind(args, kwargs))].append(time.perf_counter() - t0)
        return out

    setattr(stage, method, wrapper)


def _make_schedule(job: RunJob, pstages):
    """The job's schedule over this rank's stages; it leaves the gradients summed over microbatches
    (``scale_grads=False``): torch scales a stage's parameters when that stage's last backward ends, which
    would scale a parameter two stages of one rank share (a tied embedding) twice, and part of it too early;
    :meth:`_Runner.step` divides each parameter once instead."""
    from torch.distributed.pipelining import schedules

    if job.schedule == "csv":
        sched = schedules._PipelineScheduleRuntime(pstages, job.microbatches, loss_fn=job.spec.loss_fn,
                                                   scale_grads=False)
        sched._load_csv(job.csv_path, format="compute_only")
        return sched
    cls = schedules.get_schedule_class(job.schedule)
    if issubclass(cls, schedules.PipelineScheduleSingle):
        return cls(pstages[0], job.microbatches, loss_fn=job.spec.loss_fn, scale_grads=False)
    return cls(pstages, job.microbatches, loss_fn=job.spec.loss_fn, scale_grads=False)


def shared_parameters(modules: list) -> list:
    """The parameters that more than one stage module holds (a tied embedding on the first and the last stage),
    in a fixed order, the same on every rank: their gradients are summed over the ranks after each step.

    >>> from torch import nn
    >>> tied = nn.Linear(2, 2)
    >>> [tuple(p.shape) for p in shared_parameters([nn.Sequential(tied), nn.Linear(2, 3), tied])]
    [(2, 2), (2,)]
    """
    holders: dict[int, list] = {}
    for m in modules:
        for p in m.parameters():
            holders.setdefault(id(p), []).append(p)
    return [ps[0] for ps in holders.values() if len(ps) > 1]


def _measure_comm(job: RunJob, rank: int, dist, torch) -> float | None:
    """Median one-way time of an activation-sized message between ranks 0 and 1."""
    if job.world_size < 2 or rank > 1:
        return None
    t = torch.zeros(job.microbatch_size, job.spec.seq, job.spec.dim, dtype=job.spec.torch_dtype())
    rounds = []
    for _ in range(30):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
        rounds.append(time.perf_counter() - t0)
    return statistics.median(rounds[5:]) / 2


class _Runner:
    """One job's stages, schedule, timers and results on one rank (inside a worker process)."""

    def __init__(self, job: RunJob, rank: int):
        import torch
        from torch.distributed.pipelining import PipelineStage

        self.job, self.rank = job, rank
        self.modules = job.spec.build_stage_modules()
        self.n = job.spec.num_stages
        self.mine = sorted(s for s, r in job.stage_ranks.items() if r == rank)
        pstages = [PipelineStage(self.modules[s], s, self.n, torch.device("cpu")) for s in self.mine]
        self.store: dict = defaultdict(list)
        self.enabled = [False]
        for st in pstages:
            _timed(st, "forward_one_chunk", lambda a, k: "F", self.store, self.enabled)
            _timed(st, "backward_one_chunk", lambda a, k: "B" if k.get("full_backward", True) else "I",
                   self.store, self.enabled)
            _timed(st, "backward_weight_one_chunk", lambda a, k: "W", self.store, self.enabled)
        self.sched = _make_schedule(job, pstages)
        self.shared = shared_parameters(self.modules)
        self.result = RankResult(rank=rank, stages=self.mine)

    def step(self, step: int, dist) -> None:
        """Run training step ``step`` (timed unless it is a warm-up step), then SGD."""
        job, mine = self.job, self.mine
        timed = step >= job.warmup
        x, y = job.spec.batch(job.microbatches * job.microbatch_size, step)
        local = [self.modules[s] for s in mine]
        for m in self.modules:  # all: a shared parameter of another rank's stage holds last step's sum
            m.zero_grad(set_to_none=True)
        losses: list = []
        args = (x if isinstance(x, tuple) else (x,)) if 0 in mine else ()  # a model of several inputs: a tuple
        kwargs = {"target": y, "losses": losses} if self.n - 1 in mine else {}
        self.enabled[0] = timed
        dist.barrier()
        t0 = time.perf_counter()
        self.sched.step(*args, **kwargs)
        self._finish_gradients(local, dist)
        elapsed = time.perf_counter() - t0
        self.enabled[0] = False
        result = self.result
        if timed:
            result.step_seconds.append(elapsed)
            # compute time of this step = all timed compute so far minus earlier steps'
            result.busy_seconds.append(sum(sum(v) for v in self.store.values()) - sum(result.busy_seconds))
        if self.n - 1 in mine:
            result.losses.append([float(v.detach()) for v in losses])
        if job.record_grads:
            result.grads.append(
                {
                    f"{s}.{name}": (p.grad.detach().clone() if p.grad is not None else None)
                    for s in mine
                    for name, p in self.modules[s].named_parameters()
                }
            )
        sgd_update(local, job.lr)

    def _finish_gradients(self, local: list, dist) -> None:
        """Divide each gradient by the microbatches once (the loss is a microbatch mean), then sum the shared
        parameters' gradients over the ranks (each rank holds its stages' part; every rank takes part)."""
        import torch

        for p in unique_parameters(local):
            if p.grad is not None:
                p.grad.div_(self.job.microbatches)
        for p in self.shared:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)

    def finish(self) -> dict:
        self.result.compute_seconds = dict(self.store)
        return self.result.__dict__


def _worker(rank: int, jobs: list[RunJob], workdir: str) -> None:
    """Run every job's steps on this rank; with several jobs, step by step in turn.

    Interleaving the jobs' steps (rotating which goes first) exposes them to
    the same machine load, so their step times compare fairly on a shared machine.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=jobs[0].world_size
    )
    try:
        runners = [_Runner(job, rank) for job in jobs]
        comm = _measure_comm(jobs[0], rank, dist, torch) if any(j.measure_comm for j in jobs) else None
        for r in runners:
            r.result.comm_seconds = comm if r.job.measure_comm else None
        first = jobs[0]
        for step in range(first.warmup + first.steps):
            shift = step % len(runners)
            for r in runners[shift:] + runners[:shift]:
                r.step(step, dist)
        torch.save([r.finish() for r in runners], os.path.join(workdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- parent


def run_job(job: RunJob, timeout: float = 120.0) -> list[RankResult]:
    """Run ``job`` on ``job.world_size`` fresh processes; return each rank's result.

    Raises :class:`OpschedError` if a rank fails or the run exceeds ``timeout``
    seconds (every process is then stopped).
    """
    return run_jobs_interleaved([job], timeout)[0]


def run_jobs_interleaved(jobs: list[RunJob], timeout: float = 600.0) -> list[list[RankResult]]:
    """Run several jobs in the same processes, one step of each in turn; results per job, per rank.

    The jobs must agree on the number of ranks, steps and warm-up steps.
    """
    if not jobs:
        return []
    for job in jobs:
        _check_job(job)
        if (job.world_size, job.steps, job.warmup) != (jobs[0].world_size, jobs[0].steps, jobs[0].warmup):
            raise OpschedError("interleaved jobs must share the number of ranks, steps and warm-up steps")
    world = jobs[0].world_size
    per_rank = run_processes(_worker, (jobs,), world, timeout)
    return [[RankResult(**per_rank[r][k]) for r in range(world)] for k in range(len(jobs))]


def run_processes(worker, args: tuple, world: int, timeout: float) -> list:
    """Start ``worker(rank, *args, workdir)`` on ``world`` spawned processes; each saves its result as
    ``workdir/rank{rank}.pt`` (``torch.save``); return them in rank order. Raises :class:`OpschedError` when a
    rank fails or the run exceeds ``timeout`` seconds (every process is then stopped). Also the launcher of
    :mod:`opsched.torchrun.dag_runtime`."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="opsched-torchrun-") as workdir:
        ctx = mp.start_processes(worker, args=(*args, workdir), nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise OpschedError(
                        f"the torch run did not finish within {timeout:.0f} s (a deadlock, or an overloaded "
                        "machine); raise the timeout or check the schedule"
                    )
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1]
            raise OpschedError(f"a pipeline rank failed: {last}") from None
        except mp.ProcessExitedException as exc:
            raise OpschedError(f"a pipeline rank exited abnormally: {exc}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(Path(workdir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _check_job(job: RunJob) -> None:
    n = job.spec.num_stages
    if sorted(job.stage_ranks) != list(range(n)):
        raise OpschedError(f"stage_ranks must map stages 0..{n - 1} to ranks, got {sorted(job.stage_ranks)}")
    used = sorted(set(job.stage_ranks.values()))
    if used != list(range(len(used))):
        raise OpschedError(f"pipeline ranks must be numbered 0..N-1 without gaps; stage_ranks uses ranks {used}")
    if job.schedule == "csv" and not job.csv_path:
        raise OpschedError("a csv run needs csv_path")
    if job.schedule != "csv" and job.schedule not in BUILTINS:
        raise OpschedError(f"unknown schedule {job.schedule!r}; choose csv or one of {sorted(BUILTINS)}")


#: a reference gradient at most this many machine epsilons (of its dtype) times the step's largest is zero but
#: for rounding: an attention key bias's is ~1e-18 of the largest in float64 (eps 2.2e-16), ~1e-8 in float32
ZERO_GRADIENT_EPS = 1000


def compare_with_reference(job: RunJob, results: list[RankResult], rtol: float = 1e-9, atol: float = 1e-12,
                           grad_rtol_of_max: float = 0.0) -> dict:
    """Check the run's losses and every gradient against one process running the same steps.

    A loss matches within ``atol + rtol * |reference|``; a gradient matches
    element by element within ``atol + rtol * |reference|`` or, when
    ``grad_rtol_of_max`` is set, as a whole within ``grad_rtol_of_max * max |reference|``
    (float32, where summation order alone moves single elements by more).

    Returns ``{"ok", "steps", "params", "max_loss_diff", "max_grad_diff", "max_rel_grad_diff", "zero_grads",
    "problems"}``; ``max_rel_grad_diff`` is the largest over parameters of max |diff| / max |reference
    gradient|, leaving out the ``zero_grads`` parameters whose reference gradient is zero but for rounding
    (at most :data:`ZERO_GRADIENT_EPS` machine epsilons times the step's largest: an attention key bias,
    which the softmax cancels), checked by the tolerances alone; ``problems`` lists each mismatch (empty when ``ok``).
    """
    import torch

    modules = job.spec.build_stage_modules()
    last = next(r for r in results if job.spec.num_stages - 1 in r.stages)
    grads = {}
    for r in results:
        for step, g in enumerate(r.grads):
            grads.setdefault(step, {}).update(g)
    problems: list[str] = []
    zero_grads: set[str] = set()
    max_loss = max_grad = max_rel = 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(job.warmup + job.steps):
            x, y = job.spec.batch(job.microbatches * job.microbatch_size, step)
            ref_losses, ref_grads = job.spec.reference_step(modules, x, y, job.microbatches)
            got = last.losses[step]
            for m, (a, b) in enumerate(zip(got, ref_losses)):
                max_loss = max(max_loss, abs(a - b))
                if abs(a - b) > atol + rtol * abs(b):
                    problems.append(f"step {step} microbatch {m}: loss {a!r} != reference {b!r}")
            if len(got) != len(ref_losses):
                problems.append(f"step {step}: {len(got)} losses, reference has {len(ref_losses)}")
            if job.record_grads:
                largest = max((float(ref.abs().max()) for ref in ref_grads.values()), default=0.0)
                for name, ref in ref_grads.items():
                    g = grads.get(step, {}).get(name)
                    if g is None:
                        problems.append(f"step {step}: no gradient for {name}")
                        continue
                    diff = float((g - ref).abs().max())
                    max_grad = max(max_grad, diff)
                    scale = float(ref.abs().max())
                    if scale <= ZERO_GRADIENT_EPS * torch.finfo(ref.dtype).eps * largest:
                        zero_grads.add(name)  # no relative error to speak of
                    else:
                        max_rel = max(max_rel, diff / scale)
                    if not (torch.allclose(g, ref, rtol=rtol, atol=atol) or diff <= grad_rtol_of_max * scale):
                        problems.append(f"step {step}: gradient of {name} differs by {diff:.3g}")
            sgd_update(modules, job.lr)
    finally:
        torch.set_num_threads(threads)
    return {
        "ok": not problems,
        "steps": job.warmup + job.steps,
        "params": len(ref_grads),
        "max_loss_diff": max_loss,
        "max_grad_diff": max_grad,
        "max_rel_grad_diff": max_rel,
        "zero_grads": len(zero_grads),
        "problems": problems,
    }


def step_seconds(results: list[RankResult]) -> list[float]:
    """Each timed step's wall time: the slowest rank's (ranks start together after a barrier)."""
    return [max(vals) for vals in zip(*(r.step_seconds for r in results))]


def compute_medians(results: list[RankResult]) -> dict[tuple[int, str], float]:
    """(stage, pass) -> median measured compute time in seconds, over all ranks and timed steps."""
    out = {}
    for r in results:
        for key, vals in r.compute_seconds.items():
            out[key] = statistics.median(vals)
    return out
