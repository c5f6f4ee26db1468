"""Keeping only the plans a runtime can run (``opsched plan --runtime``), and what a plan's stages hold.

:class:`RuntimeFilter` asks the export's own checks (:func:`opsched.export.runtimes.refusal`), with the plan.json
fields a plan would be written with, of every baseline, upper solution and finished plan of the search
(:mod:`opsched.plan.search`), and keeps the reasons of those it leaves out; :func:`_stage_contents` says what each
stage holds in the model's own blocks, which those fields are built from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import networkx as nx

from opsched.cost.cluster import Cluster, Training
from opsched.plan.contiguous import contiguous_baselines, fewer_device_baselines
from opsched.errors import NoRunnablePlan
from opsched.export.runtimes import RUNTIMES, layout_fields, refusal
from opsched.schedule import Schedule
from opsched.upper.mip import CostTable
from opsched.upper.stages import StageContents, held_block, stage_contents
from opsched.plan.plan_records import Baseline, Candidate, LowerJob, Option, ScheduledPlan

log = logging.getLogger(__name__)


def _job_name(cand: Candidate) -> str:
    """Which candidate a lower progress line is about."""
    if cand.source == "contiguous":
        return f"the best baseline's split {cand.layout}"
    return f"layout {cand.layout} as the placement MIP placed it"


def _job_blocks(job: LowerJob) -> dict[int, list[tuple[int, str]]]:
    """Stage id -> (block id of the reduced graph, mode name) of a job's stages."""
    if job.plan is not None:
        return {sid: [(b, job.plan.modes_of_stage[sid][b]) for b in blocks] for sid, blocks in job.plan.blocks_of_stage.items()}
    return job.split.stage_blocks


def _baseline_option(b: Baseline) -> Option:
    """A baseline itself is a plan the search may return."""
    return Option(layout=b.layout, schedule=b.schedule, step_time=b.step_time, grad_sync=b.grad_sync,
                  source=f"baseline {b.method}", metrics={"solver": "none", "solve_seconds": b.solve_seconds},
                  stage_blocks=b.stage_blocks, contents=b.contents, microbatch_size=b.microbatch_size,
                  recompute=b.recompute, recompute_modules=b.recompute_modules)


@dataclass
class RuntimeFilter:
    """Keeps only what ``runtime`` can run (every candidate when it is None), asking the export's own checks
    (:func:`opsched.export.runtimes.refusal`) with the plan.json fields the plan would be written with."""

    runtime: str | None
    training: Training
    members: dict[int, list[int]]  # reduced block -> the model's blocks it stands for
    bg: nx.DiGraph
    all_jobs: list[LowerJob] = field(default_factory=list)  # every job, kept or refused, for the candidates table
    reasons: list[str] = field(default_factory=list)  # why each candidate left out cannot run on the runtime

    def all_baselines(self, small: nx.DiGraph, cluster: Cluster, limit: float, today: list[Baseline] | None,
                      table: CostTable | None = None, deadline: float | None = None, workers: int = 1,
                      found_elsewhere: bool = False) -> tuple[list[Baseline], Baseline | None, dict[str, str]]:
        """:func:`contiguous_baselines` on ``small``, the best of them on fewer devices
        (:func:`fewer_device_baselines`) and the Megatron-style layouts (``today``), those the runtime can run,
        by step time (on a tie, the one using more devices first); the best contiguous one on every device
        (the lower level's split); method -> why refused. Past ``deadline`` the contiguous splits stop as soon as
        a plan exists: one of theirs, one of ``today`` or, with ``found_elsewhere``, one the caller holds."""
        rows, best_split, refused = contiguous_baselines(small, cluster, self.training, limit, table, deadline, workers,
                                                         found_elsewhere=found_elsewhere or bool(today))
        fewer = fewer_device_baselines(small, cluster, self.training, limit, deadline, workers)
        today = list(today or [])
        if self.runtime is not None:
            rows, today = self.baselines(rows, refused), self.baselines(today, refused)
            fewer = self.baselines(fewer, {})  # a method's reason is the one on every device
            best_split = rows[0] if rows else None
        # Megatron-style layouts (opsched.plan.layout_search.search_layouts), offered like the hand-written baselines
        return (sorted(rows + fewer + today, key=lambda b: (b.step_time, -b.schedule.stage_graph.num_devices,
                                                            b.method)),
                best_split, refused)

    def contents(self, plan: ScheduledPlan) -> dict[int, StageContents]:
        return plan.contents or _stage_contents(plan.stage_blocks, self.members, self.bg)

    def reason(self, plan: ScheduledPlan) -> str | None:
        """Why the runtime cannot run ``plan`` as plan.json would have it (None: it can, or no runtime asked)."""
        if self.runtime is None:
            return None
        t = self.training
        doc = layout_fields(self.contents(plan), plan.microbatch_size or t.microbatch_size, t.zero,
                            plan.recompute or t.recompute, t.optimizer_state, t.tp_comm_overlap, t.attention,
                            t.dtype, t.recompute_modules if plan.recompute_modules is None else plan.recompute_modules)
        return refusal(self.runtime, plan.schedule, doc)

    def baselines(self, rows: list[Baseline], refused: dict[str, str]) -> list[Baseline]:
        """The rows the runtime can run; each other one's reason goes into ``refused`` (method -> reason)."""
        kept = []
        for b in rows:
            why = self.reason(b)
            if why is None:
                kept.append(b)
            else:
                refused[b.method] = f"{b.layout}: {why}"
                self.reasons.append(refused[b.method])
                log.info("baseline: %s on %s left out for --runtime %s: %s", b.method, b.layout, self.runtime, why)
        return kept

    def jobs(self, jobs: list[LowerJob], microbatches: int) -> list[LowerJob]:
        """The upper solutions' stages the runtime can run, asked before the lower level orders them."""
        self.all_jobs = list(jobs)
        kept = []
        for job in jobs:
            unordered = ScheduledPlan(job.candidate.layout, Schedule(job.stage_graph, microbatches, [], name="mip"),
                                      0.0, 0.0, stage_blocks=_job_blocks(job))
            why = self.reason(unordered) if job.plan else None
            if why is None:
                kept.append(job)
            else:
                job.candidate.status = f"not scheduled: {why}"
                self.reasons.append(f"{job.candidate.source} {job.candidate.layout}: {why}")
                log.info("lower: %s left out for --runtime %s: %s", _job_name(job.candidate), self.runtime, why)
        return kept

    def options(self, options: list[Option]) -> list[Option]:
        """The finished plans the runtime can run, their orders checked too (:meth:`none_left` when none is)."""
        if self.runtime is None:
            return options
        kept = []
        for o in options:
            why = self.reason(o)
            if why is None:
                kept.append(o)
            else:
                self.reasons.append(f"{o.source} {o.layout}: {why}")
        if not kept:
            self.none_left()
        return kept

    def none_left(self) -> None:
        """Raise :class:`NoRunnablePlan` when candidates were left out for the runtime (else the caller says
        that nothing fits)."""
        if self.reasons:
            raise NoRunnablePlan(f"no plan found can run on {self.runtime} (opsched export {RUNTIMES[self.runtime].export_flags}): "
                                 f"{self.reasons[0]}", list(self.reasons))


def _stage_contents(
    held: dict[int, list[tuple[int, str]]], members: dict[int, list[int]], bg: nx.DiGraph
) -> dict[int, StageContents]:
    """Stage id -> what it holds, in the model's own blocks (each reduced block stands for its ``members``)."""
    return {
        sid: stage_contents([held_block(bg.nodes[m]["block"], mode) for b, mode in blocks for m in members[b]])
        for sid, blocks in held.items()
    }

