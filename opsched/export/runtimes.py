"""Which runtimes can execute a plan: the export's own checks, asked before anything is written.

One home for "can runtime R run this plan": :func:`refusal` runs exactly the
code ``opsched export`` runs for R and returns its one-line refusal, or None
when the export would succeed. ``opsched plan --runtime R`` keeps only the
candidates R can run, and plan.json, report.md and the summary list the
runtimes that can run the chosen plan (:func:`verdicts`).

========== ===================================================== =============================================
runtime    the export that must succeed                          what it runs
========== ===================================================== =============================================
torch      ``opsched export PLAN --torch-csv F.csv``             the plan's own order, torch.distributed.pipelining
megatron   ``opsched export PLAN --megatron F``                  the layout; Megatron runs its own (interleaved) 1F1B
torchtitan ``opsched export PLAN --torchtitan F.toml --torch-csv F.csv``  the layout and the plan's own order
========== ===================================================== =============================================

torchtitan is asked with the CSV beside the TOML, since that runs any order
torch can run (a plan made by the MIP has no torch schedule by name); a plan
whose method has one exports without the CSV too.

>>> from dataclasses import replace
>>> from opsched.schedule import Schedule, StageGraph, chain_stage_graph
>>> chain = chain_stage_graph(2)        # stage k on devices 2k and 2k+1:
>>> sg = StageGraph([replace(s, devices=(2 * s.id, 2 * s.id + 1)) for s in chain.stages], chain.edges, num_devices=4)
>>> doc = {"microbatch_size": 1, "zero": 1, "recompute": "none",
...        "stage_contents": {"0": {"modules": ["model.embed_tokens", "model.layers.0"], "config": "tp2"},
...                           "1": {"modules": ["model.layers.1", "model.norm", "lm_head"], "config": "dp2"}}}
>>> refusal("torch", Schedule(sg, 8, [], name="1f1b"), doc) is None
True
>>> print(refusal("megatron", Schedule(sg, 8, [], name="1f1b"), doc))
Megatron-LM cannot run this plan: its stages use different parallel configurations (stage 0: tp2, stage 1: dp2); a framework sets one for the whole model
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping

from opsched.errors import OpschedError
from opsched.export.megatron import megatron_file
from opsched.export.plan_layout import check_torch_can_run
from opsched.export.torch_csv import TORCH_RUNTIME, check_expressible, torch_rows
from opsched.export.torchtitan import torchtitan_file
from opsched.schedule import Schedule, cached_on, order_from_schedule
from opsched.upper.stages import StageContents

#: the place names in the files the export would write; nothing is written when only asking
_PLAN, _CSV = "plan.json", "schedule.csv"


@dataclass(frozen=True)
class Runtime:
    """A runtime a plan is made for (``opsched plan --runtime``): what it can do, asked instead of its name."""

    #: its name on the command line
    name: str
    #: the ``opsched export`` options that write its files (docs/export.md)
    export_flags: str
    #: builds each pipeline stage from whole numbered layers (:func:`opsched.export.plan_layout.check_whole_layers`;
    #: Megatron-LM's and torchtitan's layer split, torch's `opsched run --hf-config`): the search keeps layers whole
    needs_whole_layers: bool
    #: one parallel configuration for the whole model, one stack of layers, whole samples per replica (Megatron-LM,
    #: torchtitan): the Megatron-style layouts are its plans, and a model of two layer stacks is not
    one_configuration: bool
    #: splits a sequence over context-parallel ranks (Megatron-LM's --context-parallel-size, torchtitan's
    #: context_parallel_degree); without it every data-parallel replica takes whole sequences
    context_parallel: bool
    #: runs tensor-parallel collectives under their GEMMs (Megatron's --tp-comm-overlap with Transformer Engine)
    overlaps_tp_comm: bool
    #: runs the plan's own order of actions from torch's CSV, so torch's checks of the order apply
    runs_plan_order: bool
    #: its file (the export ``refuse`` runs first), raising OpschedError for a plan it cannot run
    check_layout: Callable[[Schedule, dict], object]
    #: runs an overlapped F&B pair overlapped (DualPipe's runtime does; torch runs OVERLAP_F_B as F then B and
    #: Megatron pairs nothing), so a pair may be costed shorter than its two passes
    overlaps_pairs: bool = False

    def refuse(self, schedule: Schedule, doc: Mapping) -> str | None:
        """Why ``opsched export`` refuses ``schedule`` (with the plan.json fields ``doc``) for this runtime; None if not.

        ``doc`` needs what the export reads besides the schedule:
        ``stage_contents``, ``microbatch_size``, ``zero``, ``recompute`` and
        ``optimizer_state`` and ``tp_comm_overlap`` (:func:`layout_fields`; a plan without them had FP32 state and
        exposed tensor-parallel collectives). A schedule without events (a candidate's stages
        before the lower level orders them) is asked about its layout only; with
        events, torch's checks of the order (complete, no deadlock) run too.
        """
        doc = dict(doc)
        try:  # in the export's order: the framework's file is made before the CSV
            self.check_layout(schedule, doc)
            if self.runs_plan_order:
                if schedule.events:
                    problem = cached_on(schedule, "torch_order", _torch_order_problem)  # the same check for all
                    if problem:
                        raise OpschedError(problem)
                else:
                    check_expressible(schedule.stage_graph, schedule.microbatches)
        except OpschedError as exc:
            return str(exc)
        return None


#: every runtime ``opsched plan --runtime`` knows, by name: the one map the CLI's choices, the report's table and
#: the planner's filter read
RUNTIMES: dict[str, Runtime] = {r.name: r for r in (
    # torch's pipeline runtime alone: no context parallelism, no tp overlap
    Runtime("torch", "--torch-csv F.csv", needs_whole_layers=True, one_configuration=False, context_parallel=False,
            overlaps_tp_comm=False, runs_plan_order=True,
            check_layout=lambda schedule, doc: check_torch_can_run(doc, TORCH_RUNTIME, copied_stages(schedule))),
    # Megatron runs its own (interleaved) 1F1B on the plan's layout
    Runtime("megatron", "--megatron F", needs_whole_layers=True, one_configuration=True, context_parallel=True,
            overlaps_tp_comm=True, runs_plan_order=False,
            check_layout=lambda schedule, doc: megatron_file(schedule, doc, _PLAN)),
    # torchtitan runs the order from torch's CSV beside its TOML
    Runtime("torchtitan", "--torchtitan F.toml --torch-csv F.csv", needs_whole_layers=True, one_configuration=True,
            context_parallel=True, overlaps_tp_comm=False, runs_plan_order=True,
            check_layout=lambda schedule, doc: torchtitan_file(schedule, doc, _PLAN, csv=_CSV, torch_check=False)),
)}

#: what ``opsched plan --runtime`` takes: a runtime, or any (every plan shape, overlapped pairs counted overlapped)
ANY = "any"


def runtime_help() -> str:
    """``opsched plan --runtime``'s help, from :data:`RUNTIMES`: each runtime with the export options that write
    its files, and which of them run an overlapped F&B pair overlapped."""
    named = ", ".join(f"{r.name} ({r.export_flags})" for r in RUNTIMES.values())
    paired = [r.name for r in RUNTIMES.values() if r.overlaps_pairs]
    pairs = (f"with {ANY} or {', '.join(paired)}" if paired else f"with {ANY}")
    return (f"keep only plans this runtime can run, so that `opsched export` writes its files: {named}; "
            f"{ANY} (default) keeps every plan. With a runtime of one configuration (Megatron-style layouts: "
            f"{', '.join(r.name for r in RUNTIMES.values() if r.one_configuration)}) those layouts (whole layers, "
            f"one configuration) join the search even without --global-batch. Only {pairs} does an overlapped F&B "
            "pair hide one pass's communication under the other's compute (as DualPipe's runtime does); the others "
            "run a pair's passes one after the other, so with them a pair costs its two passes")


def runtime_named(name: str) -> Runtime | None:
    """The runtime ``opsched plan --runtime NAME`` asks for; None for ``any``.

    >>> runtime_named("megatron").one_configuration, runtime_named("any")
    (True, None)
    """
    if name == ANY:
        return None
    if name not in RUNTIMES:
        raise ValueError(f"unknown runtime {name!r}; one of {', '.join(RUNTIMES)}")
    return RUNTIMES[name]


def runtime_overlaps_pairs(name: str) -> bool:
    """Whether a plan for ``--runtime NAME`` may count an overlapped F&B pair shorter than its two passes: with any,
    for a runtime that overlaps them as DualPipe's does; else as the named runtime runs them.

    >>> runtime_overlaps_pairs("any"), runtime_overlaps_pairs("torch")
    (True, False)
    """
    runtime = runtime_named(name)
    return runtime is None or runtime.overlaps_pairs


def refusal(runtime: str, schedule: Schedule, doc: Mapping) -> str | None:
    """Why ``opsched export`` refuses ``schedule`` for the runtime named ``runtime``; None if not
    (:meth:`Runtime.refuse`)."""
    return runtime_named(runtime).refuse(schedule, doc)


def framework_files(schedule: Schedule, doc: dict, plan_path: str, torch_csv: str | None, torch_check: bool,
                    **paths: str | None) -> list[tuple[str, str, str]]:
    """``opsched export``'s framework files (``paths``: export option -> where, None for one not asked), made and
    checked, nothing written: (path, text, what its summary line says) each, or OpschedError for a plan one of
    them cannot run. The CSV (``torch_csv``) is torch's own and written by the command; torchtitan points at it.
    """
    texts: list[tuple[str, str, str]] = []
    if paths.get("megatron"):
        mfile = megatron_file(schedule, doc, plan_path)
        texts.append((paths["megatron"], mfile.text,
                      f"Megatron-LM arguments for {mfile.layout.describe()}, {len(mfile.args)} flags"))
    if paths.get("torchtitan"):
        csv = os.path.abspath(torch_csv) if torch_csv else None  # torchtitan opens it from its own cwd
        tfile = torchtitan_file(schedule, doc, plan_path, csv, torch_check)
        order = f"the plan's order from {torch_csv}" if csv else f"torch's {tfile.schedule} schedule"
        texts.append((paths["torchtitan"], tfile.text, f"torchtitan configuration for {tfile.layout.describe()}, "
                      + (order if tfile.layout.parallel.pp > 1 else "no pipeline")))
    return texts


def copied_stages(schedule: Schedule) -> set[int]:
    """The ids of the stages that copy another (DualPipe's second direction): they hold what it holds."""
    return {s.id for s in schedule.stage_graph.stages if s.copy_of is not None}


def _torch_order_problem(schedule: Schedule) -> str:
    """Why torch's runtime cannot run the schedule's order ("" if it can): :func:`torch_rows`'s checks."""
    try:
        torch_rows(schedule.stage_graph, order_from_schedule(schedule), schedule.microbatches)
    except OpschedError as exc:
        return str(exc)
    return ""


def verdicts(schedule: Schedule, doc: Mapping) -> dict[str, str | None]:
    """Runtime -> why it cannot run the plan (None: it can), for every runtime of :data:`RUNTIMES`."""
    return {runtime: refusal(runtime, schedule, doc) for runtime in RUNTIMES}


def layout_fields(contents: Mapping[int, StageContents], microbatch_size: int, zero: int, recompute: str,
                  optimizer_state: str = "fp32", tp_comm_overlap: bool = False, attention: str = "fused",
                  dtype: str = "bf16", recompute_modules: tuple[str, ...] = ()) -> dict:
    """The plan.json fields besides the schedule that a runtime's export reads (``opsched plan`` writes them so).

    >>> from opsched.upper.stages import stage_contents
    >>> sorted(layout_fields({0: stage_contents([("model/layers.0", "tp2")])}, 1, 1, "none"))
    ['attention', 'dtype', 'microbatch_size', 'optimizer_state', 'recompute', 'stage_contents', 'tp_comm_overlap', 'zero']
    """
    return {
        "microbatch_size": microbatch_size,
        "zero": zero,
        "recompute": recompute,
        "optimizer_state": optimizer_state,
        "tp_comm_overlap": tp_comm_overlap,
        "attention": attention,
        "dtype": dtype,
        "stage_contents": {str(k): c.to_dict() for k, c in contents.items()},
        # Megatron's names, only when the plan recomputes by module (plans without them read as before)
        **({"recompute_modules": list(recompute_modules)} if recompute_modules else {}),
    }
