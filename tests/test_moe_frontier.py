"""MoE at the frontier (issue 43): parallel folding in full, node-limited routing, DualPipe in evaluate."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.cost.collectives import alltoall_time, node_limited_alltoall_time
from opsched.cost.cluster import Training, preset
from opsched.cost.parallel_layout import ParallelLayout
from opsched.errors import OpschedError
from opsched.model.coarsen import coarsen
from opsched.model.onnx_import import import_onnx
from opsched.plan.chunk_cost import _block_shard, _rank_devices
from opsched.plan.layouts import evaluate_layout, model_index

MODELS = Path(__file__).resolve().parent.parent / "models"


@pytest.fixture(scope="module")
def deepseek_moe():
    """DeepSeek-MoE-16B (64 routed experts top-6 in layers 1-27) at 512 tokens a sequence."""
    return coarsen(import_onnx(MODELS / "deepseek_moe.onnx", dims={"batch": 1, "seq": 512}))


def run(bg, devices, layout, cluster="h100-sxm", global_batch=64):
    return evaluate_layout(bg, preset(cluster, devices), Training(), ParallelLayout.parse(layout),
                           global_batch=global_batch, micro_batch_size=1, tokens_per_sequence=512)


def test_tp2_with_ep32_on_32_ranks_per_stage_is_a_layout():
    """Megatron-Core's parallel folding: the expert grid need not sit inside the data-parallel replicas."""
    lay = ParallelLayout.parse("tp=2,pp=2,ep=32,etp=1").resolved(64)
    assert lay.dp == 16 and lay.ep * 1 == lay.tp * lay.dp
    groups = _rank_devices(lay, 64, 1)
    assert groups.expert == tuple(range(32, 64))  # etp 1: the 32 expert ranks are the stage's devices in order
    assert groups.expert_weights == (32,)  # each expert held once per stage
    with pytest.raises(OpschedError, match="ep x etp = 32 x 2 must divide tp x cp x dp = 2 x 1 x 16 = 32"):
        ParallelLayout.parse("tp=2,pp=2,ep=32").resolved(64)  # etp defaults to tp: a grid of 64 on 32 devices


@pytest.mark.parametrize("layout", ["tp=2,ep=32,etp=1", "tp=2,ep=16,etp=2", "tp=2,ep=8", "tp=1,ep=64,dp=64",
                                    "tp=2,cp=2,ep=16,etp=1"])
def test_each_device_holds_one_ep_x_etp_th_of_the_experts(deepseek_moe, layout):
    lay = ParallelLayout.parse(layout).resolved(64)
    index = model_index(deepseek_moe)
    expert = next(b for b in index.order if index.experts_of[b])
    block = deepseek_moe.nodes[expert]["block"]
    params, replicas = _block_shard(block, True, lay)
    grid = lay.ep * (lay.etp or lay.tp)
    assert params == pytest.approx(block.param_count / grid) and replicas * grid == 64


def test_folding_evaluates_and_the_expert_grid_changes_only_what_it_should(deepseek_moe):
    """TP2 x EP32 (ETP1) and TP2 x EP8 (ETP2, the old rule) on 64 H100s: the same dense work; ETP1 holds a quarter
    of the experts per device, and its experts run no tensor-parallel collectives."""
    folded = run(deepseek_moe, 64, "tp=2,pp=2,ep=32,etp=1,sp=1,zero=1")
    inside = run(deepseek_moe, 64, "tp=2,pp=2,ep=8,sp=1,zero=1")
    assert folded.fits is not None and folded.step_time > 0 and folded.layout.etp == 1
    assert folded.peak_memory_bytes < inside.peak_memory_bytes  # experts 32 x 1 ways, not 8 x 2
    assert "etp1" in str(folded.layout)


@settings(max_examples=200, deadline=None)
@given(nbytes=st.floats(1e3, 1e10), copies=st.floats(1, 16), nodes=st.integers(2, 16), per_node=st.integers(1, 8),
       max_nodes=st.integers(1, 16), nv=st.floats(1e10, 1e12), ib=st.floats(1e9, 1e10),
       nv_lat=st.floats(0, 5e-6), ib_extra=st.floats(0, 1e-5))
def test_node_limited_routing_never_costs_more_than_the_plain_all_to_all(nbytes, copies, nodes, per_node, max_nodes,
                                                                         nv, ib, nv_lat, ib_extra):
    """NVLink at least as fast as the network: sending each token once per chosen node and forwarding on NVLink
    moves no more over the network and no more in all than every copy at the network's speed."""
    ranks = nodes * per_node
    ib = min(ib, nv)
    plain = alltoall_time(nbytes, ranks, ib, nv_lat + ib_extra)
    limited = node_limited_alltoall_time(nbytes, copies, ranks, nodes, max_nodes, (nv, nv_lat), (ib, nv_lat + ib_extra))
    assert limited <= plain * (1 + 1e-12)


def test_node_limited_routing_shortens_deepseeks_cross_node_dispatch(deepseek_moe):
    """EP32 over 4 H800 nodes: each token's experts on at most 2 nodes cut the network traffic, so the step."""
    free = run(deepseek_moe, 32, "tp=1,pp=1,ep=32,zero=1", cluster="h800", global_batch=32)
    limited = run(deepseek_moe, 32, "tp=1,pp=1,ep=32,zero=1,max_nodes=2", cluster="h800", global_batch=32)
    one_node = run(deepseek_moe, 32, "tp=1,pp=1,ep=8,zero=1,max_nodes=2", cluster="h800", global_batch=32)
    assert limited.step_time < free.step_time
    assert "max_nodes=2" in str(limited.layout)
    # on one node the limit changes nothing: no network to save
    assert one_node.step_time == run(deepseek_moe, 32, "tp=1,pp=1,ep=8,zero=1", cluster="h800",
                                     global_batch=32).step_time


def test_routed_copies_are_the_layers_top_k(deepseek_moe):
    index = model_index(deepseek_moe)
    copies = {round(v, 6) for v in index.routed_copies.values()}
    assert copies == {6.0}  # DeepSeek-MoE-16B routes each token to 6 experts


def test_evaluate_runs_dualpipe_on_two_copies_of_the_chunks(deepseek_moe):
    """DeepSeek's schedule on its kind of layout (PP4, EP8): two copies of the 4 chunks in opposite directions,
    each rank holding chunk r and chunk 3 - r, so twice the parameters and both copies' optimizer steps; fewer
    bubbles than 1F1B on the same chunks."""
    dual = evaluate_layout(deepseek_moe, preset("h100-sxm", 32), Training(), ParallelLayout.parse("pp=4,ep=8,zero=1"),
                           global_batch=64, micro_batch_size=1, tokens_per_sequence=512, schedule="dualpipe")
    plain = run(deepseek_moe, 32, "pp=4,ep=8,zero=1")
    assert len(dual.schedule.stage_graph.stages) == 8 and dual.schedule_name == "dualpipe"
    held = [sum(s.param_bytes for s in dual.schedule.stage_graph.stages if r in s.devices) for r in range(4)]
    once = [sum(s.param_bytes for s in plain.schedule.stage_graph.stages if r in s.devices) for r in range(4)]
    assert held == pytest.approx([once[r] + once[3 - r] for r in range(4)])
    assert dual.breakdown["pipeline_bubbles"] < plain.breakdown["pipeline_bubbles"]
    assert dual.breakdown["optimizer_step"] > plain.breakdown["optimizer_step"]


def test_fp8_dispatches_in_fp8_and_combines_in_bf16(deepseek_moe):
    """DeepSeek-V3's FP8 recipe: dispatch moves FP8 tokens, combine BF16. With EP32 over 4 H800 nodes an expert's
    all-to-alls' bytes (its communication, latency aside) shrink by a quarter: one of the two halved."""
    from opsched.cost.cluster import cluster_from_dict
    from opsched.plan.chunk_cost import _block_share, _ChunkLinks

    lay = ParallelLayout.parse("ep=32,zero=1").resolved(32)
    cluster = cluster_from_dict({"preset": "h800", "devices": 32, "intra_node_latency": 0, "inter_node_latency": 0})
    groups = _rank_devices(lay, 32, 0)
    links = _ChunkLinks.of(groups, lay, cluster)
    index = model_index(deepseek_moe)
    b = next(b for b in index.order if index.experts_of[b])
    share = {dtype: _block_share(deepseek_moe.nodes[b]["block"], index.tokens_in[b], index.expert_share[b], lay,
                                 groups, links, cluster, Training(dtype=dtype), index.routed_copies[b])
             for dtype in ("bf16", "fp8")}
    ratio = share["fp8"].cost.f_comm / share["bf16"].cost.f_comm
    assert ratio == pytest.approx(0.75)


def test_the_step_splits_as_deepseek_reports_it_and_sums_to_the_step(deepseek_moe):
    dual = evaluate_layout(deepseek_moe, preset("h100-sxm", 32), Training(), ParallelLayout.parse("pp=4,ep=8,zero=1"),
                           global_batch=64, micro_batch_size=1, tokens_per_sequence=512, schedule="dualpipe")
    phases = dual.phases
    assert sum(phases) == pytest.approx(dual.step_time)
    assert phases.pairs > 0 and phases.forward_only > 0 and min(phases) >= 0
    assert dual.to_dict()["phases"]["pairs"] == phases.pairs
    plain = run(deepseek_moe, 32, "pp=4,ep=8,zero=1")
    assert plain.phases.pairs == 0 and plain.phases.w_only == 0  # 1F1B pairs nothing and splits no backward


def test_recompute_modules_cost_their_forward_again_and_store_less(deepseek_moe):
    """Megatron's recompute modules (DeepSeek-V3 ran layernorm and mla_up_proj): each named module's forward runs
    again in the backward and keeps nothing for it; more modules, more time, less memory."""
    base = run(deepseek_moe, 32, "pp=4,ep=8,zero=1")
    norms = run(deepseek_moe, 32, "pp=4,ep=8,zero=1,recompute_modules=layernorm")
    more = run(deepseek_moe, 32, "pp=4,ep=8,zero=1,recompute_modules=layernorm,moe,shared_experts")
    assert base.peak_memory_bytes > norms.peak_memory_bytes > more.peak_memory_bytes
    assert base.step_time < norms.step_time < more.step_time
    assert "recompute_modules=layernorm+moe+shared_experts" in str(more.layout)
    core = run(deepseek_moe, 32, "pp=4,ep=8,zero=1,recompute_modules=core_attn")
    selective = run(deepseek_moe, 32, "pp=4,ep=8,zero=1,recompute=selective")
    assert core.step_time == pytest.approx(selective.step_time, rel=1e-6)  # the same attention core again


@pytest.mark.parametrize("text, words", [("recompute_modules=norms", "name Megatron's modules"),
                                         ("recompute=full,recompute_modules=mlp", "leave recompute out")])
def test_bad_recompute_modules_are_refused_in_one_line(text, words):
    with pytest.raises(OpschedError, match=words) as caught:
        ParallelLayout.parse(text).resolved(8)
    assert "\n" not in str(caught.value)


def test_every_part_of_a_moe_model_is_found(deepseek_moe):
    parts = {p.part for b in deepseek_moe.nodes for p in deepseek_moe.nodes[b]["block"].parts}
    assert {"core_attn", "layernorm", "mlp", "moe_act", "moe_experts", "shared_experts"} <= parts


@settings(max_examples=200, deadline=None)
@given(nbytes=st.floats(1e3, 1e10), nodes=st.integers(1, 16), per_node=st.integers(1, 8),
       nv=st.floats(1e10, 1e12), ib=st.floats(1e9, 1e10), nv_lat=st.floats(0, 5e-6), ib_extra=st.floats(0, 1e-5))
def test_an_all_to_all_across_nodes_costs_between_its_network_share_and_all_of_it(nbytes, nodes, per_node, nv, ib,
                                                                                  nv_lat, ib_extra):
    """Each peer's share over the link that reaches it: no dearer than every byte at the network's speed, no
    cheaper than the bytes that must leave the node at the network's speed."""
    from opsched.cost.collectives import spread_alltoall_time

    ranks, ib = nodes * per_node, min(ib, nv)
    spread = spread_alltoall_time(nbytes, ranks, nodes, (nv, nv_lat), (ib, nv_lat + ib_extra))
    assert spread <= alltoall_time(nbytes, ranks, ib, nv_lat + ib_extra) * (1 + 1e-12)
    assert spread >= nbytes * (ranks - per_node) / ranks / ib * (1 - 1e-12)
