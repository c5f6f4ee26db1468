"""The placements the MIP searches, built from one chain of work the way the hand-written schedules place it.

``--placement auto`` tries, in this order (ties keep the earliest):

* ``chain``: one stage per device, stage k on device k (the rule of 1F1B);
* ``v``: 2D stages in a V, device i holds stages i and 2D-1-i (ZB-V, DualPipeV);
* ``interleaved``: v = max(2, P // D) chunks per device, stage k on device
  k mod D (interleaved 1F1B);
* ``bidirectional``: DualPipe's two copies of a D-stage chain fed from both
  ends, each running half of the microbatches; each device holds the
  parameters of both its copies, and they count toward its memory.

Each placement regroups the chain (merging consecutive stages or splitting
each one into equal parts) exactly as the baseline whose rule it is
(:mod:`opsched.schedule.placement`), so the MIP and the baselines schedule
the same work on the same devices. Every hand-written order that runs on a
placement is that placement's warm start. The lower level then solves each
one at the same memory (:func:`opsched.lower.placements.solve_placements`).

>>> from opsched.schedule import chain_stage_graph
>>> found = placements_to_try(chain_stage_graph(4), 8)
>>> [c.placement for c in found] == list(SEARCHED)
True
>>> {c.placement: len(c.stage_graph.stages) for c in found if c.placement in ("chain", "v", "bidirectional")}
{'chain': 4, 'v': 8, 'bidirectional': 8}
>>> sorted(found[1].warm_orders)
['dualpipev', 'zb-v']
"""

from __future__ import annotations

from opsched.baselines import METHODS, baseline_orders, dualpipe, placement_of
from opsched.schedule.placement import PLACEMENTS, dual_graph, graph_onto_groups, on_group_devices
from opsched.errors import OpschedError, Unsupported
from opsched.lower.placements import PlacementToTry
from opsched.schedule import StageGraph

#: the placements ``auto`` tries, in order: every placement there is
SEARCHED = tuple(PLACEMENTS)
#: what ``--placement`` accepts
CHOICES = ("auto", *SEARCHED)


def _rule_of(placement: str):
    """The baseline module whose rule ``placement`` is: the first method (in the baselines' order) so placed."""
    for name, module in METHODS.items():
        if placement_of(name) == placement:
            return module
    raise LookupError(f"placement {placement!r} has no baseline whose PLACEMENT names it; mip re-places a chain by "
                      "that baseline's rule (docs/architecture.md, 'Add a placement')")


#: the baseline module whose placement rule each one is
RULE_OF = {name: _rule_of(name) for name in SEARCHED}
#: the name the graph as given (a plan's own placement) is tried under
AS_GIVEN = "as given"


def placed(sg: StageGraph, microbatches: int, placement: str, comm: float | None = None) -> StageGraph:
    """The chain ``sg`` re-placed as ``placement`` (one of :data:`SEARCHED`) on its devices.

    Raises Unsupported when the chain cannot be placed that way (a branching
    graph, stage counts that do not divide, fewer than 2 microbatches for the
    two directions). ``comm`` is the transfer time of a new cross-device edge
    (default: the largest edge time of ``sg``).

    >>> from opsched.schedule import chain_stage_graph, device_param_bytes
    >>> two = placed(chain_stage_graph(4, param_bytes=3.0), 8, "bidirectional")
    >>> device_param_bytes(two)   # both copies' parameters on every device
    [6.0, 6.0, 6.0, 6.0]
    """
    if placement not in RULE_OF:
        raise OpschedError(f"unknown placement {placement!r}; choose from {', '.join(CHOICES)}")
    if PLACEMENTS[placement].copies == 2:
        # DualPipe's own order needs M >= 2·PP; the placement itself only needs a microbatch per direction
        if microbatches < 2:
            raise Unsupported(f"bidirectional runs half of the microbatches each way: needs at least 2, got {microbatches}")
        return dual_graph(sg, microbatches, dualpipe.devices_of, comm)
    return RULE_OF[placement].place(sg, microbatches, comm)


def placements_to_try(sg: StageGraph, microbatches: int, choice: str = "auto", *, as_given: bool = False,
                      comm: float | None = None) -> list[PlacementToTry]:
    """The placements to solve for ``choice`` (``auto`` or one of :data:`SEARCHED`), each with its warm orders.

    ``as_given``: also try ``sg`` exactly as it is placed, first (a plan's
    stage graph, which may branch or use device groups, so that no
    re-placement holds it), unless one of the placements tried is that same
    graph. A placement that cannot hold the chain is a candidate with the
    reason in ``refused``.
    """
    if choice not in CHOICES:
        raise OpschedError(f"--placement: unknown placement {choice!r}; choose from {', '.join(CHOICES)}")
    out = []
    for name in SEARCHED if choice == "auto" else (choice,):
        try:
            # a plan's stages on device groups: placed with each group as one device, as the baselines place them
            pseudo, groups = on_group_devices(sg)
            graph = placed(pseudo, microbatches, name, comm)
            if pseudo is not sg:
                graph = graph_onto_groups(graph, groups, sg.num_devices)
        except Unsupported as exc:
            out.append(PlacementToTry(name, None, refused=str(exc)))
            continue
        out.append(PlacementToTry(name, graph, baseline_orders(graph, microbatches)))
    if as_given and all(c.stage_graph != sg for c in out):
        out.insert(0, PlacementToTry(AS_GIVEN, sg, baseline_orders(sg, microbatches)))
    return out
