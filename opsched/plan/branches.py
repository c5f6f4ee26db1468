"""Branches on or off (``plan --branches``): the block graph as it is, or as one chain.

A sequential pipeline (GPipe, 1F1B, Megatron-LM) runs a model's blocks in one
order: each stage holds a run of consecutive blocks and waits for the stage
before it, even when the model has parallel branches (towers, encoders) that
could run side by side on groups of their own (GraphPipe's stage DAG).
:func:`chain_only` gives the upper level exactly that choice: it orders every
block after the one before it in a topological order, with an edge of no
bytes where the model has none, so every slot holds a run of consecutive
blocks and the stage graph is a chain (its other edges, which carry the
model's tensors, join a stage to a later one and add no parallelism).

``--branches on`` (the default) plans the graph as it is and, when it has
parallel blocks, also plans :func:`chain_only` of it last
(:func:`opsched.plan.search.plan_block_graph`), so the plan is never slower
than ``--branches off`` when the time limit does not bind. With parallel
towers (:func:`has_parallel_towers`) the chain keeps a part of the clock
(``CHAIN_SHARE``); with an MoE layer's experts alone it gets what is left, so
an MoE plan keeps the whole clock, as before.
"""

from __future__ import annotations

import networkx as nx

from opsched.cost.blocks import expert_count
from opsched.model.graph import Block  # noqa: F401 (the doctests build blocks)
from opsched.upper.towers import regions  # the upper level's rule of what a branch is, not a copy of it


def block_order(bg: nx.DiGraph) -> list[int]:
    """A topological order of the blocks, the lowest id first among the ready ones. Ids are the import's order:
    a model exported tower by tower keeps each tower's layers together here, one built layer by layer across its
    towers (GraphPipe's MMT) interleaves them, so a chain cut from this order may mix towers in one stage."""
    return list(nx.lexicographical_topological_sort(bg))


def has_parallel_blocks(bg: nx.DiGraph) -> bool:
    """Whether two blocks have no path between them, i.e. the topological order is not unique: some two blocks
    consecutive in :func:`block_order` have no edge (a DAG's topological order is unique iff every consecutive
    pair in it is an edge).

    >>> g = nx.DiGraph([(0, 1), (0, 2), (1, 3), (2, 3)])
    >>> has_parallel_blocks(g), has_parallel_blocks(chain_only(g))
    (True, False)
    """
    order = block_order(bg)
    return any(not bg.has_edge(u, v) for u, v in zip(order, order[1:]))


def has_parallel_towers(bg: nx.DiGraph) -> bool:
    """Whether blocks outside every expert are parallel (towers, encoders), not only an MoE layer's experts: some
    two blocks consecutive in :func:`block_order`, neither holding experts, have no edge.

    >>> g = nx.DiGraph([(0, 1), (0, 2), (1, 3), (2, 3)])
    >>> for i, name in enumerate(["router", "experts.0", "experts.1", "combine"]):
    ...     g.nodes[i]["block"] = Block(i, name, (name,), (name,))
    >>> has_parallel_blocks(g), has_parallel_towers(g)
    (True, False)
    """
    order = block_order(bg)
    plain = {b: expert_count(bg.nodes[b]["block"]) == 0 for b in order}
    return any(plain[u] and plain[v] and not bg.has_edge(u, v) for u, v in zip(order, order[1:]))


def heaviest_fork(bg: nx.DiGraph) -> tuple[float, float] | None:
    """The shares of the model's FLOPs in the two heaviest branches of its fork with the most work, or None
    without one: a fork is a region between blocks every other block reaches or is reached from, with two
    branches or more and no expert in it (:func:`opsched.upper.towers.regions`). Two branches of equal work can
    run side by side on groups of equal size; a branch of 1 % beside one of 0 % (LLaVA's vision tower beside its
    text embedding) leaves the groups of the lighter one idle.

    >>> g = nx.DiGraph([(0, 1), (0, 2), (1, 3), (2, 3)])
    >>> for i, flops in enumerate([0.0, 3.0, 1.0, 0.0]):
    ...     g.nodes[i]["block"] = Block(i, f"b{i}", (), (), flops=flops)
    >>> heaviest_fork(g)
    (0.75, 0.25)
    """
    flops = {b: bg.nodes[b]["block"].flops for b in bg}
    total = sum(flops.values())
    forks = [r for r in regions(block_order(bg), list(bg.edges))
             if len(r) >= 2 and not any(expert_count(bg.nodes[b]["block"]) for t in r for b in t)]
    if not forks or total <= 0:
        return None
    fork = max(forks, key=lambda r: sum(flops[b] for t in r for b in t))
    work = sorted((sum(flops[b] for b in t) / total for t in fork), reverse=True)
    return work[0], work[1]


def chain_only(bg: nx.DiGraph) -> nx.DiGraph:
    """``bg`` with an edge of 0 bytes (and no tensors) from each block to the next in :func:`block_order` where it
    has none: the upper level can then only cut it into runs of consecutive blocks (see the module docstring).

    >>> g = nx.DiGraph([(0, 1), (0, 2)], kind="BlockGraph")
    >>> sorted(chain_only(g).edges(data="bytes"), key=str)
    [(0, 1, None), (0, 2, None), (1, 2, 0.0)]
    """
    chain = bg.copy()
    order = block_order(bg)
    for u, v in zip(order, order[1:]):
        if not chain.has_edge(u, v):
            chain.add_edge(u, v, bytes=0.0, tensors=[])
    return chain
