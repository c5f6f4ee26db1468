"""Coarsening: DAG, exact costs, parallel branches kept apart, target block counts."""

from __future__ import annotations

import itertools

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import block_of_ops, make_moe_model, real_export, save
from opsched.model.coarsen import coarsen, parallel_branches
from opsched.errors import OpschedError
from opsched.model.graph import COST_FIELDS, OpNode, add_op, new_op_graph, totals
from opsched.model.onnx_import import import_onnx


def check_block_graph(op_graph, bg):
    """The invariants every BlockGraph must satisfy; returns the op -> block map."""
    assert bg.graph["kind"] == "BlockGraph"
    assert nx.is_directed_acyclic_graph(bg)
    # ids are 0..n-1 in a topological order
    assert sorted(bg.nodes) == list(range(bg.number_of_nodes()))
    assert all(u < v for u, v in bg.edges)
    owner = block_of_ops(bg)
    assert sorted(owner) == sorted(op_graph.nodes)  # every op in exactly one block
    assert sum(len(b.ops) for _, b in bg.nodes(data="block")) == op_graph.number_of_nodes()
    t_ops, t_blocks = totals(op_graph), totals(bg)
    for f in COST_FIELDS:
        assert t_blocks[f] == pytest.approx(t_ops[f], rel=1e-12, abs=1e-9), f
    for b, block in bg.nodes(data="block"):
        assert block.flops == pytest.approx(sum(op_graph.nodes[v]["op"].flops for v in block.ops))
        assert list(block.ops) == sorted(block.ops, key=list(nx.topological_sort(op_graph)).index)
    # block edges: exactly the op edges that cross blocks, carrying each crossing tensor once
    expected: dict = {}
    tensor_bytes = op_graph.graph.get("tensor_bytes", {})
    for u, v, data in op_graph.edges(data=True):
        a, b = owner[u], owner[v]
        if a != b:
            for t in data.get("tensors", []):
                size = 0.0 if op_graph.nodes[v]["op"].op_type in ("Shape", "Size") else tensor_bytes.get(t, 0.0)
                expected.setdefault((a, b), {})[t] = max(expected.get((a, b), {}).get(t, 0.0), size)
    assert set(bg.edges) == set(expected)
    for (a, b), tensors in expected.items():
        assert bg.edges[a, b]["bytes"] == pytest.approx(sum(tensors.values()))
    return owner


def expert_blocks(bg, layer_prefix=()):
    """{(layer scope, expert name): block ids} for blocks whose scope holds an experts.N module."""
    out: dict = {}
    for b, block in bg.nodes(data="block"):
        for i, part in enumerate(block.scope):
            if part.startswith(("experts.", "shared_experts.")):
                out.setdefault((block.scope[:i], part), set()).add(b)
    return out


def assert_experts_apart(bg):
    groups = expert_blocks(bg)
    assert groups, "no expert blocks found"
    by_layer: dict = {}
    for (layer, expert), blocks in groups.items():
        by_layer.setdefault(layer, []).append(blocks)
    for layer, sets in by_layer.items():
        assert len(sets) >= 2
        for s1, s2 in itertools.combinations(sets, 2):
            assert not (s1 & s2)
            for a in s1:
                for b in s2:
                    assert not nx.has_path(bg, a, b) and not nx.has_path(bg, b, a), (layer, a, b)
    return by_layer


MOE_EXPORTS = ["moe_capacity.dynamo.onnx", "moe_capacity.legacy.onnx",
               "deepseek_lm_2L_sh1_r4.dynamo.onnx", "deepseek_lm_2L_sh1_r4.legacy.onnx"]


@pytest.mark.parametrize("name", MOE_EXPORTS)
@pytest.mark.parametrize("depth, target", [(None, None), (0, None), (1, None), (3, None), (None, 3), (0, 1)])
def test_real_moe_exports_keep_experts_apart(name, depth, target):
    g = import_onnx(real_export(name))
    bg = coarsen(g, depth=depth, target_blocks=target)
    check_block_graph(g, bg)
    by_layer = assert_experts_apart(bg)
    layers = 2 if name.startswith("deepseek") else 1
    experts = 5 if name.startswith("deepseek") else 4  # deepseek: 4 routed + 1 shared per layer
    assert len(by_layer) == layers
    assert all(len(sets) == experts for sets in by_layer.values())
    if depth is None or depth <= 1:
        assert parallel_branches(bg) == experts
    else:  # finer blocks: an expert's w1 and w3 projections are parallel too
        assert parallel_branches(bg) >= experts
    if target is not None:
        assert bg.graph["target_met"] is False  # experts cannot be merged away


def test_default_coarsening_is_per_layer():
    g = import_onnx(real_export("deepseek_lm_2L_sh1_r4.legacy.onnx"))
    bg = coarsen(g)
    names = [b.name for _, b in bg.nodes(data="block")]
    # each layer: attention + router, 4 routed and 1 shared expert, combine step
    assert sum(n.startswith("layers.0/mlp/experts.") for n in names) == 4
    assert "layers.0/mlp/shared_experts.0" in names
    assert bg.number_of_nodes() <= 2 * 7 + 3


@pytest.mark.parametrize("name", ["clip.dynamo.onnx", "clip.legacy.onnx"])
def test_clip_towers_stay_apart(name):
    g = import_onnx(real_export(name))
    for target in (None, 2):
        bg = coarsen(g, depth=0, target_blocks=target)  # even the coarsest depth keeps towers apart
        check_block_graph(g, bg)
        vision = {b for b, blk in bg.nodes(data="block") if blk.scope[:1] == ("vision_model",) and blk.flops}
        text = {b for b, blk in bg.nodes(data="block") if blk.scope[:1] == ("text_model",) and blk.flops}
        assert vision and text
        for a in vision:
            for b in text:
                assert not nx.has_path(bg, a, b) and not nx.has_path(bg, b, a)
        assert parallel_branches(bg) == 2


def test_llava_real_export_and_target():
    g = import_onnx(real_export("llava.legacy.onnx"))
    for target in (None, 20, 4, 1):
        bg = coarsen(g, target_blocks=target)
        check_block_graph(g, bg)
    # LLaVA is a chain of towers (vision -> projector -> language model): 1 branch
    assert parallel_branches(coarsen(g)) == 1


def _op(name, scope, flops=1.0, op_type="Add"):
    return OpNode(name, op_type, tuple(scope), flops=flops, output_bytes=4.0, io_bytes=8.0)


def test_residual_in_parent_scope_does_not_create_a_cycle():
    # parent-scope op p1 feeds child c, and p2 (parent scope again) reads both: merging by
    # scope alone would make {p1, p2} <-> {c} a cycle.
    g = new_op_graph("res")
    for name, scope in [("p1", ("layer",)), ("c", ("layer", "mlp")), ("p2", ("layer",))]:
        add_op(g, _op(name, scope))
    for u, v, t in [("p1", "c", "a"), ("c", "p2", "b"), ("p1", "p2", "a")]:
        g.add_edge(u, v, bytes=4.0, tensors=[t])
    g.graph["tensor_bytes"] = {"a": 4.0, "b": 4.0}
    bg = coarsen(g, depth=2)
    check_block_graph(g, bg)
    assert bg.number_of_nodes() == 3
    # at depth 1 all three share one label and one block
    assert coarsen(g, depth=1).number_of_nodes() == 1
    # the edge p1 -> {c, p2} carries tensor "a" once although two ops read it
    bg2 = coarsen(g, depth=2)
    owner = block_of_ops(bg2)
    assert bg2.edges[owner["p1"], owner["c"]]["bytes"] == 4.0


def test_chain_contraction_reaches_target_and_keeps_costs():
    g = new_op_graph("chain")
    prev = None
    for i in range(12):
        add_op(g, _op(f"op{i}", (f"layers.{i}",), flops=float(i + 1)))
        if prev:
            g.add_edge(prev, f"op{i}", bytes=4.0, tensors=[f"t{i}"])
        prev = f"op{i}"
    g.graph["tensor_bytes"] = {f"t{i}": 4.0 for i in range(12)}
    assert coarsen(g).number_of_nodes() == 12
    for target in (1, 3, 5, 12, 40):
        bg = coarsen(g, target_blocks=target)
        check_block_graph(g, bg)
        assert bg.number_of_nodes() == min(target, 12)
        assert bg.graph["target_met"]
    # the small blocks merge first: with 3 blocks the last (largest) layer stays alone or nearly
    sizes = sorted(b.flops for _, b in coarsen(g, target_blocks=3).nodes(data="block"))
    assert max(sizes) <= 0.6 * sum(sizes)


def test_builder_models_both_styles_coarsen_alike(tmp_path):
    for routing in ("nonzero", "dense"):
        sizes = []
        for style in ("dynamo", "legacy"):
            m = make_moe_model(style, layers=3, experts=4, routing=routing, shared_expert=True)
            g = import_onnx(save(m, tmp_path / f"{style}.onnx"), dims={"batch": 2, "seq": 8})
            bg = coarsen(g)
            check_block_graph(g, bg)
            by_layer = assert_experts_apart(bg)
            assert len(by_layer) == 3 and all(len(s) == 5 for s in by_layer.values())
            sizes.append(sorted(round(b.flops) for _, b in bg.nodes(data="block") if b.flops))
        assert sizes[0] == sizes[1]


def test_deterministic():
    g = import_onnx(real_export("deepseek_lm_2L_sh1_r4.dynamo.onnx"))
    a, b = coarsen(g, target_blocks=5), coarsen(g, target_blocks=5)
    assert [blk.ops for _, blk in a.nodes(data="block")] == [blk.ops for _, blk in b.nodes(data="block")]
    assert list(a.edges(data="bytes")) == list(b.edges(data="bytes"))


def test_bad_arguments():
    g = new_op_graph("x")
    with pytest.raises(OpschedError):
        coarsen(g)
    add_op(g, _op("a", ()))
    with pytest.raises(OpschedError, match="--blocks"):
        coarsen(g, target_blocks=0)
    with pytest.raises(OpschedError, match="--depth"):
        coarsen(g, depth=-1)
    add_op(g, _op("b", ()))
    g.add_edge("a", "b")
    g.add_edge("b", "a")
    with pytest.raises(OpschedError, match="cycle"):
        coarsen(g)


def test_parallel_branches_measure():
    assert parallel_branches(nx.DiGraph([(0, 1), (1, 2)])) == 1
    diamond = nx.DiGraph([(0, 1), (0, 2), (0, 3), (1, 4), (2, 4), (3, 4)])
    assert parallel_branches(diamond) == 3


SCOPES = [(), ("a",), ("a", "x"), ("a", "experts.0"), ("a", "experts.1"), ("b",), ("b", "experts.0"),
          ("layers.0",), ("layers.1",)]


@st.composite
def random_op_graphs(draw):
    n = draw(st.integers(1, 25))
    g = new_op_graph("random")
    for i in range(n):
        scope = draw(st.sampled_from(SCOPES))
        add_op(g, _op(f"n{i}", scope, flops=float(draw(st.integers(0, 5)))))
        g.nodes[f"n{i}"]["const"] = draw(st.booleans()) and i < 3
    for j in range(1, n):
        for i in draw(st.sets(st.integers(0, j - 1), max_size=3)):
            g.add_edge(f"n{i}", f"n{j}", bytes=4.0, tensors=[f"t{i}"])
    for v in list(g.nodes):  # "const" ops only depend on const ops
        if g.nodes[v]["const"] and any(not g.nodes[u]["const"] for u in g.predecessors(v)):
            g.nodes[v]["const"] = False
    g.graph["tensor_bytes"] = {f"t{i}": 4.0 for i in range(n)}
    return g


@settings(max_examples=80, deadline=None)
@given(random_op_graphs(), st.sampled_from([None, 0, 1, 2]), st.sampled_from([None, 1, 3, 8]))
def test_random_graphs_give_valid_block_graphs(g, depth, target):
    bg = coarsen(g, depth=depth, target_blocks=target)
    owner = check_block_graph(g, bg)
    # sibling experts with no path between their ops keep blocks with no path between them
    # (ops computed from constants only are constants, whatever their scope: not branch work)
    e0 = [v for v in g.nodes if g.nodes[v]["op"].scope == ("a", "experts.0") and not g.nodes[v]["const"]]
    e1 = [v for v in g.nodes if g.nodes[v]["op"].scope == ("a", "experts.1") and not g.nodes[v]["const"]]
    apart = not any(nx.has_path(g, u, v) or nx.has_path(g, v, u) for u in e0 for v in e1)
    if e0 and e1 and apart:
        for u in e0:
            for v in e1:
                a, b = owner[u], owner[v]
                assert a != b and not nx.has_path(bg, a, b) and not nx.has_path(bg, b, a)
    if target is not None and bg.graph["target_met"]:
        assert bg.number_of_nodes() <= target


def test_batched_experts_coarsen_like_separate_experts():
    # A tiny HF Mixtral whose experts are stacked [4, ...] weights (tests/data/make_hf_moe.py):
    # after import each layer has 4 expert blocks, parallel, one expert each, and the
    # reduced graph offers expert parallelism on the merged experts as for per-expert exports.
    from opsched.cost.blocks import expert_count, modes_for
    from opsched.upper.reduce import reduce_block_graph

    bg = coarsen(import_onnx(real_export("mixtral_batched_experts.dynamo.onnx")))
    experts = [bg.nodes[b]["block"] for b in bg if expert_count(bg.nodes[b]["block"]) > 0]
    assert len(experts) == 2 * 4
    assert all(expert_count(b) == 1 and b.param_count == (96 * 32 + 32 * 48) for b in experts)
    assert parallel_branches(bg) == 4
    small, _ = reduce_block_graph(bg, target=12)
    merged = [b for b in small if small.nodes[b]["expert_params"] > 0]
    assert len(merged) == 2
    for b in merged:
        block = small.nodes[b]["block"]
        assert expert_count(block) == 4 and small.nodes[b]["expert_params"] == 4 * (96 * 32 + 32 * 48)
        assert any(m.ep == 4 for m in modes_for(block, 4))
