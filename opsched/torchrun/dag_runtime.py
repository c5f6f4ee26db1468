"""Run a plan whose stage graph is a DAG on CPU processes, with torch.distributed point-to-point transfers.

torch.distributed.pipelining (and Megatron-LM, torchtitan) pass activations
from stage k to stage k+1 only, so a plan whose stages branch (CLIP's two
towers on different device groups, joined by the loss stage; GraphPipe's
multi-modal transformer) cannot run there. This executor runs it:

* one gloo process per device group (rank r = the r-th group, numbered by
  smallest device as :func:`opsched.export.torch_csv.torch_ranks` numbers them);
* each rank runs its stages' passes (F, B, or I and W) in the order the plan's
  schedule gives them (an overlapped pair as its two passes, F first);
* a forward receives every named tensor its stage reads along each incoming
  edge of the stage graph (a join receives from each producer), runs the stage
  and sends each outgoing edge its tensors (a fork sends to each consumer); a
  backward receives the gradients of its outputs from every consumer, sums
  those of a tensor sent to several, and sends its inputs' gradients back;
  W computes the weight gradients of what I differentiated;
* sends are non-blocking (``isend``, completed at the end of the step), receives
  block: a rank waits only on a pass its schedule orders before, on another
  rank, and the plan's order is validated deadlock-free, so the run is too;
  every message has its own tag ``(microbatch, edge, tensor, direction)``, so a
  receive can only match the tensor it waits for, whatever the timing;
* a transfer between two stages of one rank is handed over in memory.

The model is a *DAG spec* (:mod:`opsched.torchrun.dag_models`): ``num_stages``,
``build_stage_modules()`` (stage k's module is called as
``module(received: dict[name, tensor], data)`` and returns a dict of named
tensors; the sink stage's holds ``"out"``, its loss is ``loss_fn(out,
target)``), ``edge_names(src, dst)`` (the names an edge carries), ``batch``
and ``reference_step`` as for :mod:`opsched.torchrun.launch`, whose
:func:`~opsched.torchrun.launch.compare_with_reference` checks the result.
Raw inputs (pixel values, token ids, a modality's features) are read by the
stage that needs them from the step's batch: data carries no gradient.

>>> _tag(microbatch=1, edge=2, tensor=0, backward=True, edges=3, width=2)
21
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from opsched.errors import OpschedError
from opsched.torchrun.launch import RankResult, run_processes
from opsched.torchrun.model import sgd_update, unique_parameters

#: a message's header: [number of dimensions, dtype code, dimensions...]: receives need shape and dtype first
HEADER = 10
#: dtype codes of the header (positions); names, so this module imports without torch
DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "bool")

Row = tuple[tuple[int, int, str], ...]  # one rank's passes in order: (stage, microbatch, pass letter)


@dataclass(frozen=True)
class DagJob:
    """What every rank runs: the DAG spec, stage -> rank, each rank's passes in order, the edges, the steps."""

    spec: Any  # a DAG spec (module docstring)
    stage_ranks: dict[int, int]
    rows: tuple[Row, ...]
    edges: tuple[tuple[int, int], ...]
    microbatches: int
    microbatch_size: int = 2
    steps: int = 2
    warmup: int = 0
    lr: float = 0.05
    record_grads: bool = True

    @property
    def world_size(self) -> int:
        return len(self.rows)

    @property
    def sink(self) -> int:
        return self.spec.num_stages - 1


def _tag(microbatch: int, edge: int, tensor: int, backward: bool, edges: int, width: int) -> int:
    """The one tag of a message: a tensor's activation (forward) or gradient (backward) on an edge for a microbatch."""
    return ((microbatch * edges + edge) * width + tensor) * 2 + int(backward)


def dag_rows(schedule) -> tuple[Row, ...]:
    """Each rank's passes in the schedule's order, after the order checks of a torch export but for the chain
    (complete, placed, a device group's devices alike, deadlock-free): pairs as their two passes, F first."""
    from opsched.export.torch_csv import checked_rank_rows
    from opsched.schedule import jobs_of, order_from_schedule

    rows = checked_rank_rows(schedule.stage_graph, order_from_schedule(schedule), schedule.microbatches,
                             "the plan's order", chain=False)
    return tuple(tuple((j.stage, j.microbatch, str(j.pass_)) for a in row for j in jobs_of(a)) for row in rows)


def dag_job(schedule, spec, microbatch_size: int = 2, steps: int = 2, max_ranks: int = 8) -> DagJob:
    """The :class:`DagJob` of a plan's schedule and a DAG spec, after the order's checks (:func:`dag_rows`)."""
    from opsched.export.torch_csv import stage_ranks

    sg = schedule.stage_graph
    rows = dag_rows(schedule)
    if len(rows) > max_ranks:
        raise OpschedError(f"the plan has {len(rows)} device groups; `opsched run` starts one process per group on "
                           f"this machine and allows at most {max_ranks}")
    return DagJob(spec, stage_ranks(sg), rows, tuple((e.src, e.dst) for e in sg.edges), schedule.microbatches,
                  microbatch_size=microbatch_size, steps=steps)


def check_dag(sg) -> None:
    """Refuse a stage graph this executor cannot run: stages running some microbatches only (DualPipe's copies),
    or not exactly one sink, the last stage (where the loss is computed)."""
    sinks = [s.id for s in sg.stages if not sg.succs(s.id)]
    if sinks != [len(sg.stages) - 1]:
        raise OpschedError(f"stages {sinks} feed no other stage; `opsched run` computes the loss on one last stage, "
                           f"stage {len(sg.stages) - 1}, which all others must lead to")
    for s in sg.stages:
        if s.microbatches is not None or s.copy_of is not None:
            raise OpschedError(f"stage {s.id} is a copy running some microbatches only (bidirectional DualPipe); "
                               "`opsched run` runs every microbatch through every stage (plan DualPipeV)")


class _Mailbox:
    """Tagged point-to-point messages between ranks; in memory between two stages of one rank."""

    def __init__(self, rank: int, dist, torch):
        self.rank, self.dist, self.torch = rank, dist, torch
        self.local: dict[int, Any] = {}
        self.pending: list = []  # (work, tensors kept alive until sent)

    def post(self, dst: int, tag: int, tensor) -> None:
        if dst == self.rank:
            self.local[tag] = tensor
            return
        t = tensor.detach().contiguous()
        dims = list(t.shape)
        if len(dims) > HEADER - 2:
            raise OpschedError(f"a tensor of {len(dims)} dimensions; messages carry at most {HEADER - 2}")
        head = [len(dims), DTYPES.index(str(t.dtype).removeprefix("torch."))] + dims
        header = self.torch.tensor(head + [0] * (HEADER - len(head)), dtype=self.torch.int64)
        for tag_, buf in ((2 * tag, header), (2 * tag + 1, t)):
            self.pending.append((self.dist.isend(buf, dst, tag=tag_), buf))

    def take(self, src: int, tag: int):
        if src == self.rank:
            return self.local.pop(tag)
        torch = self.torch
        header = torch.empty(HEADER, dtype=torch.int64)
        self.dist.recv(header, src, tag=2 * tag)
        ndim, code = int(header[0]), int(header[1])
        t = torch.empty([int(d) for d in header[2:2 + ndim]], dtype=getattr(torch, DTYPES[code]))
        self.dist.recv(t, src, tag=2 * tag + 1)
        return t

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


@dataclass
class _Pass:
    """What a stage's forward of one microbatch leaves for its backward."""

    received: dict  # name -> the leaf tensor the stage read
    out: dict  # name -> tensor
    roots: list = field(default_factory=list)  # what I differentiated, for W
    grads: list = field(default_factory=list)


class _DagRunner:
    """One rank's stages, its row of passes and its results (inside a worker process)."""

    def __init__(self, job: DagJob, rank: int, dist):
        import torch

        self.job, self.rank, self.torch = job, rank, torch
        self.spec = job.spec
        self.modules = job.spec.build_stage_modules()
        self.mine = sorted(s for s, r in job.stage_ranks.items() if r == rank)
        self.ins: dict[int, list] = defaultdict(list)  # stage -> [(edge index, producer)]
        self.outs: dict[int, list] = defaultdict(list)  # stage -> [(edge index, consumer)]
        self.names = [tuple(job.spec.edge_names(src, dst)) for src, dst in job.edges]
        for e, (src, dst) in enumerate(job.edges):
            self.outs[src].append((e, dst))
            self.ins[dst].append((e, src))
        self.width = max((len(n) for n in self.names), default=1) or 1
        self.mail = _Mailbox(rank, dist, torch)
        self.store: dict = defaultdict(list)
        self.result = RankResult(rank=rank, stages=self.mine)

    def tag(self, m: int, e: int, k: int, backward: bool) -> int:
        return _tag(m, e, k, backward, len(self.job.edges), self.width)

    def step(self, step: int, dist) -> None:
        """Run training step ``step``: this rank's passes in order, then SGD on its stages."""
        job = self.job
        x, y = self.spec.batch(job.microbatches * job.microbatch_size, step)
        xs = list(zip(*(t.chunk(job.microbatches) for t in x))) if isinstance(x, tuple) else list(
            x.chunk(job.microbatches))
        ys = list(y.chunk(job.microbatches))
        local = [self.modules[s] for s in self.mine]
        for m in self.modules:
            m.zero_grad(set_to_none=True)
        state: dict[tuple[int, int], _Pass] = {}
        losses: dict[int, float] = {}
        timed = step >= job.warmup
        dist.barrier()
        t0 = time.perf_counter()
        for s, m, p in job.rows[self.rank]:
            start = time.perf_counter()
            if p == "F":
                self._forward(s, m, xs[m], ys[m], state, losses)
            elif p in ("B", "I"):
                self._backward(s, m, p, state)
            else:
                self._weights(s, m, state)
            if timed:
                self.store[(s, p)].append(time.perf_counter() - start)
        self.mail.flush()
        for p in unique_parameters(local):
            if p.grad is not None:
                p.grad.div_(job.microbatches)  # the loss is the mean over microbatches: divide once
        if timed:
            self.result.step_seconds.append(time.perf_counter() - t0)
        if job.sink in self.mine:
            self.result.losses.append([losses[m] for m in sorted(losses)])
        if job.record_grads:
            self.result.grads.append({f"{s}.{name}": (p.grad.detach().clone() if p.grad is not None else None)
                                      for s in self.mine for name, p in self.modules[s].named_parameters()})
        sgd_update(local, job.lr)

    def _forward(self, s: int, m: int, data, target, state: dict, losses: dict) -> None:
        received = {}
        for e, src in self.ins[s]:
            for k, name in enumerate(self.names[e]):
                t = self.mail.take(self.job.stage_ranks[src], self.tag(m, e, k, False))
                received[name] = t.detach().requires_grad_(t.is_floating_point())
        out = self.modules[s](received, data)
        if s == self.job.sink:
            loss = self.spec.loss_fn(out["out"], target)
            losses[m] = float(loss.detach())
            out = {"loss": loss}
        for e, dst in self.outs[s]:
            for k, name in enumerate(self.names[e]):
                self.mail.post(self.job.stage_ranks[dst], self.tag(m, e, k, False), out[name])
        state[(s, m)] = _Pass(received, out)

    def _backward(self, s: int, m: int, p: str, state: dict) -> None:
        """B (input and weight gradients) or I (input gradients only) of stage ``s``, microbatch ``m``."""
        torch, rec = self.torch, state[(s, m)]
        if s == self.job.sink:
            roots, grads = [rec.out["loss"]], [None]
        else:
            summed: dict[str, Any] = {}  # a tensor sent to several consumers: the sum of their gradients
            for e, dst in self.outs[s]:
                for k, name in enumerate(self.names[e]):
                    g = self.mail.take(self.job.stage_ranks[dst], self.tag(m, e, k, True))
                    summed[name] = g if name not in summed else summed[name] + g
            pairs = [(rec.out[n], g) for n, g in summed.items() if rec.out[n].requires_grad]
            roots, grads = [r for r, _ in pairs], [g for _, g in pairs]
        leaves = [t for t in rec.received.values() if t.requires_grad]
        found: list = [None] * len(leaves)
        if roots and p == "B":
            torch.autograd.backward(roots, grads)
            found = [t.grad for t in leaves]
        elif roots and leaves:
            found = list(torch.autograd.grad(roots, leaves, grads, retain_graph=True, allow_unused=True))
        by_leaf = {id(t): g for t, g in zip(leaves, found)}
        for e, src in self.ins[s]:
            for k, name in enumerate(self.names[e]):
                t = rec.received[name]
                g = by_leaf.get(id(t))
                self.mail.post(self.job.stage_ranks[src], self.tag(m, e, k, True),
                               g if g is not None else torch.zeros_like(t))
        if p == "B":
            del state[(s, m)]
        else:
            rec.roots, rec.grads = roots, grads

    def _weights(self, s: int, m: int, state: dict) -> None:
        """W: the weight gradients of what stage ``s``'s I differentiated, added to each parameter's gradient."""
        rec = state.pop((s, m))
        params = [p for p in self.modules[s].parameters() if p.requires_grad]
        if not rec.roots or not params:
            return
        for p, g in zip(params, self.torch.autograd.grad(rec.roots, params, rec.grads, allow_unused=True)):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g

    def finish(self) -> dict:
        self.result.compute_seconds = dict(self.store)
        return self.result.__dict__


def _dag_worker(rank: int, job: DagJob, workdir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=job.world_size)
    try:
        runner = _DagRunner(job, rank, dist)
        for step in range(job.warmup + job.steps):
            runner.step(step, dist)
        torch.save(runner.finish(), os.path.join(workdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_dag_job(job: DagJob, timeout: float = 120.0) -> list[RankResult]:
    """Run ``job`` on ``job.world_size`` fresh processes (gloo, one thread each); each rank's result."""
    stages = sorted(job.stage_ranks)
    if stages != list(range(job.spec.num_stages)):
        raise OpschedError(f"stage_ranks must map stages 0..{job.spec.num_stages - 1}, got {stages}")
    per_rank = run_processes(_dag_worker, (job,), job.world_size, timeout)
    return [RankResult(**r) for r in per_rank]
