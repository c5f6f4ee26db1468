"""``plan --branches on|off``: off gives a chain of stages; on is never slower than off (a property test)."""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opsched.cost.cluster import Training, cluster_from_dict
from opsched.model.graph import Block
from opsched.plan.branches import block_order, chain_only, has_parallel_blocks, heaviest_fork
from opsched.plan.report import plan_shape_lines
from opsched.plan.search import PlanOptions, plan_block_graph
from opsched.schedule import validate
from helpers import SLOW_LINK_CLUSTER


def branchy_graph(towers: list[list[float]], join_flops: float = 0.1e12) -> nx.DiGraph:
    """input -> towers (chains of blocks of the given TFLOPs) -> join: ids in import order (tower by tower)."""
    g = nx.DiGraph(kind="BlockGraph")

    def add(name: str, flops: float) -> int:
        i = g.number_of_nodes()
        g.add_node(i, block=Block(i, name, (name,), (name,), flops=flops, param_count=10**7, output_bytes=1e7,
                                  saved_bytes=1e7, tp_comm_bytes=1e7))
        return i

    source = add("in", 0.1e12)
    ends = []
    for t, tower in enumerate(towers):
        prev = source
        for k, flops in enumerate(tower):
            cur = add(f"t{t}.{k}", flops)
            g.add_edge(prev, cur, bytes=1e6)
            prev = cur
        ends.append(prev)
    join = add("join", join_flops)
    g.add_edges_from(((e, join) for e in ends), bytes=1e6)
    return g


def is_chain(sg) -> bool:
    """Every stage but the first of its pipeline waits for the one before it (stages numbered in topological
    order; data-parallel replicas of a pipeline, which share no edge, are chains each)."""
    g = nx.DiGraph()
    g.add_nodes_from(s.id for s in sg.stages)
    g.add_edges_from((e.src, e.dst) for e in sg.edges)
    for part in nx.weakly_connected_components(g):
        ids = sorted(part)
        if not all(g.has_edge(a, b) for a, b in zip(ids, ids[1:])):
            return False
    return True


def test_chain_only_orders_the_towers_one_after_the_other():
    g = branchy_graph([[1e12, 1e12], [1e12]])
    assert has_parallel_blocks(g) and not has_parallel_blocks(chain_only(g))
    assert block_order(g) == [0, 1, 2, 3, 4]  # tower 0's blocks together, then tower 1's
    chain = chain_only(g)
    assert chain.edges[2, 3]["bytes"] == 0.0 and set(g.edges) < set(chain.edges)


def test_heaviest_fork_weighs_towers_and_leaves_experts_out():
    g = branchy_graph([[1e12, 1e12], [2e12], [0.5e12]])
    total = 0.1e12 + 4.5e12 + 0.1e12
    assert heaviest_fork(g) == pytest.approx((2e12 / total, 2e12 / total))
    assert heaviest_fork(chain_only(g)) is None  # one chain: no fork
    experts = branchy_graph([[1e12], [1e12]])
    for b in (1, 2):
        name = f"mlp.experts.{b - 1}"
        experts.nodes[b]["block"] = Block(b, name, (name,), (name,), flops=1e12)
    assert heaviest_fork(experts) is None  # an MoE layer's experts are not branches


@pytest.mark.slow
def test_off_gives_a_chain_of_stages_and_on_may_run_towers_side_by_side():
    g = branchy_graph([[2e12, 2e12], [2e12, 2e12]])
    cluster = cluster_from_dict(SLOW_LINK_CLUSTER)
    off = plan_block_graph(g, cluster, Training(microbatches=4), PlanOptions(time_limit=20, branches=False))
    on = plan_block_graph(g, cluster, Training(microbatches=4), PlanOptions(time_limit=20))
    validate(off.schedule)
    validate(on.schedule)
    assert is_chain(off.schedule.stage_graph) and off.chain_step_time is None
    assert on.chain_step_time is not None and on.step_time <= on.chain_step_time
    assert on.step_time <= off.step_time * (1 + 1e-9)


towers = st.lists(st.lists(st.sampled_from([0.5e12, 1e12, 2e12, 4e12]), min_size=1, max_size=3), min_size=2,
                  max_size=3)


def never_slower(towers: list[list[float]], microbatches: int, devices: int) -> None:
    g = branchy_graph(towers)
    cluster = cluster_from_dict({**SLOW_LINK_CLUSTER, "devices": devices})
    training = Training(microbatches=microbatches)
    off = plan_block_graph(g, cluster, training, PlanOptions(time_limit=30, branches=False))
    on = plan_block_graph(g, cluster, training, PlanOptions(time_limit=30))
    validate(on.schedule)
    validate(off.schedule)
    assert is_chain(off.schedule.stage_graph)
    assert on.step_time <= off.step_time * (1 + 1e-9), (on.source, on.layout, off.source, off.layout)
    # the summary says why a plan is a chain: told so, or the plans with branches apart were slower (named)
    assert off.branch_search == "off" and "(--branches off)" in dict(plan_shape_lines(off))["branches"]
    assert on.branch_search == "searched" and on.fork_shares is not None and sum(on.fork_shares) <= 1 + 1e-9
    if on.side_by_side is not None:
        assert on.side_by_side.step_time >= on.step_time * (1 - 1e-9)
        assert on.side_by_side.layout in dict(plan_shape_lines(on))["branches"]


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(towers=towers, microbatches=st.sampled_from([2, 4]))
def test_branches_never_make_a_plan_slower(towers, microbatches):
    """On random branchy graphs small enough that work budgets, not the clock, decide both searches: the plan
    with branches is at most the plan with --branches off (the chain's plan is one of its options), and the
    plan with branches off is a chain of stages."""
    never_slower(towers, microbatches, devices=2)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(towers=towers, microbatches=st.sampled_from([2, 4, 8]))
def test_branches_never_make_a_plan_slower_on_four_nodes(towers, microbatches):
    never_slower(towers, microbatches, devices=4)
