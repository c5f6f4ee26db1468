"""Cost model against hand computation (issue 5 item 2)."""

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import SLOW_LINK_CLUSTER
from opsched.cost.cluster import Training, cluster_from_dict
from opsched.cost.blocks import (
    Mode,
    block_cost,
    expert_count,
    modes_for,
    roofline_time,
)
from opsched.cost.collectives import allreduce_time, alltoall_time, transfer_time
from opsched.errors import OpschedError
from opsched.model.graph import Block

# round numbers so every figure below is easy to check by hand (efficiency 0.5
# of 100 TFLOP/s: 50 TFLOP/s achievable), on 2 nodes of 4 devices
SPEC = {**SLOW_LINK_CLUSTER, "devices": 8, "devices_per_node": 4}
C = cluster_from_dict(SPEC)
T = Training(microbatches=4)

#: the H100 preset with one efficiency (0.5) for every operator: no efficiency by kind
ONE_ROOFLINE = {"preset": "h100-sxm", "devices": 8, "efficiency": 0.5, "matmul_efficiency": {},
                "attention_efficiency": None, "memory_efficiency": 1.0}


def block(flops=50e12, io=0.0, params=1_000_000, out=1e9, ops=(), tp_bytes=1e9):
    return Block(0, "b", ("layers.0",), tuple(ops), flops=flops, param_count=params, output_bytes=out, saved_bytes=out, io_bytes=io,
                 tp_comm_bytes=tp_bytes)


def test_roofline_takes_the_slower_of_compute_and_memory():
    assert roofline_time(50e12, 0.0, C, "bf16") == pytest.approx(1.0)  # 50e12 / 50e12
    assert roofline_time(1e9, 3e12, C, "bf16") == pytest.approx(3.0)  # 3e12 B / 1e12 B/s


def test_single_device_backward_split():
    c = block_cost(block(), Mode(), (0,), C, T)
    assert (c.F, c.I, c.W) == pytest.approx((1.0, 1.0, 1.0))  # B = 2F split I = F, W = F
    assert c.param_bytes == 16e6  # 1e6 params x 16 bytes
    assert c.act_bytes == 1e9 and c.act_w_bytes == 0.5e9
    assert c.grad_sync == 0.0


def test_block_without_weights_has_no_w():
    c = block_cost(block(params=0), Mode(), (0,), C, T)
    assert (c.F, c.I, c.W) == pytest.approx((1.0, 1.0, 0.0))
    assert c.act_w_bytes == 0.0 and c.param_bytes == 0.0


def test_tensor_parallel_adds_one_all_reduce_per_f_and_i():
    # the all-reduce moves the row-parallel outputs (1e9 B), not every tensor the block writes (5e9 B)
    c = block_cost(block(out=5e9), Mode(tp=4), (0, 1, 2, 3), C, T)
    # compute 1/4 s; ring all-reduce of 1e9 B on 4 ranks intra-node: 2*3*1e-6 + 2*3/4*1e9/100e9 = 0.015006
    comm = 6e-6 + 1.5 * 1e9 / 100e9
    assert c.F == pytest.approx(0.25 + comm)
    assert c.I == pytest.approx(0.25 + comm)
    assert c.W == pytest.approx(0.25)
    assert c.param_bytes == pytest.approx(4e6)
    assert c.act_bytes == pytest.approx(5e9 / 4)


def test_llama_layer_all_reduces_two_residual_sized_tensors():
    """Megatron's figure: per layer, two all-reduces of b x s x h in F (here b=1, s=4096, h=4096, bf16)."""
    from opsched.model.coarsen import coarsen
    from opsched.model.onnx_import import import_onnx

    bg = coarsen(import_onnx(Path(__file__).resolve().parents[1] / "models" / "llama_7b.onnx"))
    layer = next(bg.nodes[b]["block"] for b in bg if bg.nodes[b]["block"].name == "model/layers.3")
    assert layer.tp_comm_bytes == 2 * 1 * 4096 * 4096 * 2
    assert layer.output_bytes > 10 * layer.tp_comm_bytes  # what the all-reduce used to be sized by


def test_data_parallel_syncs_gradients_once_per_step():
    c = block_cost(block(), Mode(dp=4), (0, 1, 2, 3), C, T)
    assert c.F == pytest.approx(0.25) and c.W == pytest.approx(0.25)
    assert c.param_bytes == 16e6  # every replica holds everything
    # all-reduce of 1e6 params x 2 bytes over 4 replicas: 6e-6 + 1.5 * 2e6 / 100e9
    assert c.grad_sync == pytest.approx(6e-6 + 1.5 * 2e6 / 100e9)


def test_groups_across_nodes_use_the_inter_node_link():
    devs = tuple(range(8))
    c = block_cost(block(), Mode(tp=2, dp=4), devs, C, T)
    # tp pair (0,1) is intra-node: 2*1e-6 + 1 * (1e9/4)/100e9
    assert c.F == pytest.approx(50e12 / 8 / 50e12 + 2e-6 + 0.25e9 / 100e9)
    # replicas 0,2,4,6 straddle two nodes: 6*10e-6 + 1.5 * (0.5e6 * 2) / 10e9
    assert c.grad_sync == pytest.approx(60e-6 + 1.5 * 1e6 / 10e9)


def test_expert_parallel_mode_and_all_to_all():
    ops = [f"layers.0/experts.{i}/w1" for i in range(4)]
    b = block(ops=ops)
    assert expert_count(b) == 4
    assert Mode(ep=4) in modes_for(b, 4)
    assert Mode(ep=4) not in modes_for(block(), 4)
    c = block_cost(b, Mode(ep=4), (0, 1, 2, 3), C, T)
    a2a = 3 * 1e-6 + 0.75 * (1e9 / 4) / 100e9
    assert c.F == pytest.approx(0.25 + 2 * a2a)
    assert c.param_bytes == pytest.approx(4e6)


def test_collectives_alpha_beta():
    assert allreduce_time(100.0, 1, 1.0, 1.0) == 0.0
    assert allreduce_time(100.0, 2, 10.0, 1.0) == pytest.approx(2 + 10)
    assert alltoall_time(100.0, 2, 10.0, 1.0) == pytest.approx(1 + 5)


def test_transfer_intra_inter_and_same_group():
    assert transfer_time(1e9, C, (0,), (1,)) == pytest.approx(1e-6 + 0.01)
    assert transfer_time(1e9, C, (3,), (4,)) == pytest.approx(10e-6 + 0.1)
    assert transfer_time(1e9, C, (0, 1), (0, 1)) == 0.0
    assert transfer_time(0.0, C, (0,), (4,)) == 0.0


def test_modes_cover_every_split_of_the_group():
    modes = modes_for(block(), 4)
    assert {str(m) for m in modes} == {"dp4", "tp2.dp2", "tp4"}
    assert all(m.size == 4 for m in modes)
    assert [str(m) for m in modes_for(block(params=0), 4)] == ["dp4"]


def test_expert_parallel_replicates_the_non_expert_part():
    ops = [f"layers.0/experts.{i}/w1" for i in range(4)]
    b = block(params=1_000_000, ops=ops)
    c = block_cost(b, Mode(ep=4), (0, 1, 2, 3), C, T, expert_params=600_000, token_bytes=4e8)
    # experts sharded 4 ways, the other 400k parameters on every device
    assert c.param_bytes == pytest.approx((600_000 / 4 + 400_000) * 16)
    # the replicated part syncs its gradients over the 4 devices once per step
    assert c.grad_sync == pytest.approx(6e-6 + 1.5 * 400_000 * 2 / 100e9)
    # all-to-alls move the given tokens, not the block's output bytes
    assert c.F == pytest.approx(0.25 + 2 * (3e-6 + 0.75 * 1e8 / 100e9))


def test_zero_shards_what_data_parallel_replicas_hold():
    """ZeRO-1 (distributed optimizer) keeps 1/dp of the 12 optimizer bytes; ZeRO-3 shards all 16."""
    from dataclasses import replace

    plain = block_cost(block(), Mode(dp=4), (0, 1, 2, 3), C, T)
    zero1 = block_cost(block(), Mode(dp=4), (0, 1, 2, 3), C, replace(T, zero=1))
    zero3 = block_cost(block(), Mode(dp=4), (0, 1, 2, 3), C, replace(T, zero=3))
    assert plain.param_bytes == 16e6
    assert zero1.param_bytes == pytest.approx(1e6 * (2 + 2 + 12 / 4))
    assert zero3.param_bytes == pytest.approx(16e6 / 4)
    # a single replica has nothing to shard over
    assert block_cost(block(), Mode(tp=4), (0, 1, 2, 3), C, replace(T, zero=3)).param_bytes == pytest.approx(4e6)
    with pytest.raises(OpschedError, match="ZeRO level"):
        Training(zero=5)


def test_bf16_optimizer_state_holds_six_bytes_per_parameter_where_fp32_holds_twelve():
    """--optimizer-state bf16 (Megatron's precision-aware optimizer): BF16 moments and the master weight as 16-bit
    remainders, 2 + 2 + 2 bytes, sharded by ZeRO-1 like the FP32 state; weights and gradients are unchanged."""
    from dataclasses import replace

    bf16 = replace(T, optimizer_state="bf16")
    assert bf16.optimizer_bytes == 6.0 and bf16.bytes_per_param == 10.0
    assert block_cost(block(), Mode(dp=4), (0, 1, 2, 3), C, bf16).param_bytes == pytest.approx(10e6)
    assert block_cost(block(), Mode(dp=4), (0, 1, 2, 3), C, replace(bf16, zero=1)).param_bytes == \
        pytest.approx(1e6 * (2 + 2 + 6 / 4))
    assert block_cost(block(), Mode(dp=4), (0, 1, 2, 3), C, replace(bf16, zero=3)).param_bytes == \
        pytest.approx(10e6 / 4)
    # an Adam step reads and writes the state, reads the gradient, writes the weight (and reads it: the remainders)
    assert (T.optimizer_step_bytes, bf16.optimizer_step_bytes) == (28.0, 18.0)
    with pytest.raises(OpschedError, match="optimizer state must be one of fp32, bf16"):
        Training(optimizer_state="fp8")


def test_operator_kinds_take_their_own_efficiency():
    """A cluster file's matmul / attention / memory efficiencies cost each kind apart; without them, one roofline."""
    from opsched.cost.cluster import preset
    from opsched.cost.blocks import compute_time

    kinds = cluster_from_dict({"preset": "h100-sxm", "devices": 8, "matmul_efficiency": {"bf16": 0.8},
                               "attention_efficiency": 0.6, "memory_efficiency": 0.9})
    b = Block(0, "layer", (), (), flops=10e12, matmul_flops=8e12, attention_flops=1e12, io_bytes=90e9,
              matmul_io_bytes=30e9, attention_io_bytes=0.0)
    peak = 989e12
    # matmuls compute-bound, attention compute-bound, the rest (1e12 FLOPs, 60e9 B) memory-bound at 0.9 x 3.35e12 B/s
    expected = 8e12 / (0.8 * peak) + 1e12 / (0.6 * peak) + 60e9 / (0.9 * 3.35e12)
    assert compute_time(b, 1, kinds, "bf16") == pytest.approx(expected)
    assert compute_time(b, 2, kinds, "bf16") == pytest.approx(expected / 2)
    # FP8 keeps attention in BF16: only the matmuls change rate
    assert compute_time(b, 1, kinds, "fp8") > 8e12 / (0.5 * 1979e12) + 1e12 / (0.6 * peak)
    # a cluster without them: one roofline at its efficiency over all FLOPs and bytes
    one = cluster_from_dict({**ONE_ROOFLINE, "efficiency": 0.5})
    assert compute_time(b, 1, one, "bf16") == pytest.approx(max(10e12 / (0.5 * peak), 90e9 / 3.35e12))
    # the presets set them: the same block costs each kind at the preset's own efficiency for it
    h100 = preset("h100-sxm")
    by_kind = (8e12 / (h100.matmul_efficiency["bf16"] * peak) + 1e12 / (h100.attention_efficiency * peak)
               + max(1e12 / (h100.efficiency * peak), 60e9 / (h100.memory_efficiency * 3.35e12)))
    assert h100.costs_by_kind and compute_time(b, 1, h100, "bf16") == pytest.approx(by_kind)


@pytest.mark.parametrize("field, value, message", [
    ("matmul_efficiency", {"bf16": 1.5}, r"matmul_efficiency\['bf16'\] is a fraction"),
    ("matmul_efficiency", 0.8, "must map dtypes"),
    ("attention_efficiency", 0, "attention_efficiency' is a fraction"),
    ("memory_efficiency", -1, "memory_efficiency' is a fraction"),
])
def test_kind_efficiencies_are_checked(field, value, message):
    with pytest.raises(OpschedError, match=message):
        cluster_from_dict({"preset": "h100-sxm", "devices": 8, field: value})


def test_full_recomputation_keeps_the_input_and_runs_the_forward_again():
    from dataclasses import replace

    plain = block_cost(block(out=5e9), Mode(tp=4), (0, 1, 2, 3), C, T, token_bytes=4e8)
    full = block_cost(block(out=5e9), Mode(tp=4), (0, 1, 2, 3), C, replace(T, recompute="full"), token_bytes=4e8)
    assert full.F == plain.F and full.W == plain.W
    assert full.I == pytest.approx(plain.I + plain.F)  # the forward, its all-reduce included, before the input gradient
    assert full.act_bytes == pytest.approx(4e8 / 4) and full.act_bytes < plain.act_bytes  # the input, split 4 ways
    with pytest.raises(OpschedError, match="recompute must be one of none, selective, full"):
        Training(recompute="some")
    # without sequence parallelism the kept input (the residual stream) is whole on each tensor rank
    whole = block_cost(block(out=5e9), Mode(tp=4), (0, 1, 2, 3), C,
                       replace(T, recompute="full", sequence_parallel=False), token_bytes=4e8)
    assert whole.act_bytes == pytest.approx(4e8)


def test_selective_recomputation_runs_the_attention_core_again_and_nothing_else():
    from dataclasses import replace

    layer = Block(0, "layer", ("layers.0",), (), flops=60e12, param_count=10, output_bytes=1e9, saved_bytes=1e9, tp_comm_bytes=1e8,
                  attention_flops=10e12, attention_io_bytes=0.0)
    plain = block_cost(layer, Mode(tp=2), (0, 1), C, T)
    selective = block_cost(layer, Mode(tp=2), (0, 1), C, replace(T, recompute="selective"))
    core = 10e12 / 2 / C.flops_per_second("bf16")  # the attention's half on each of 2 ranks, at the one efficiency
    assert selective.I == pytest.approx(plain.I + core) and core > 0
    assert (selective.F, selective.W) == (plain.F, plain.W)
    # a fused attention never writes its scores: nothing more is dropped; a block without attention costs as before
    assert selective.act_bytes == plain.act_bytes
    # an unfused one's scores (Korthikanti's 5as^2b) are dropped, split over the ranks like the rest
    unfused = replace(layer, attention_scores_bytes=6e8)
    kept = block_cost(unfused, Mode(tp=2), (0, 1), C, replace(T, recompute="selective"))
    assert kept.act_bytes == pytest.approx(plain.act_bytes - 3e8) and kept.act_w_bytes <= kept.act_bytes
    assert block_cost(block(), Mode(), (0,), C, replace(T, recompute="selective")) == block_cost(block(), Mode(), (0,), C, T)


def test_sequence_parallelism_splits_what_tensor_ranks_hold_whole():
    from dataclasses import replace

    # Korthikanti et al. 2022 Table 2, per layer in units of sbh: 34 stored, 10 of them outside the tp regions
    layer = Block(0, "layer", ("layers.0",), (), flops=1e12, param_count=10, output_bytes=34.0, saved_bytes=34.0,
                  tp_replicated_bytes=10.0)
    for t in (2, 4, 8):
        devices = tuple(range(t))
        sp = block_cost(layer, Mode(tp=t), devices, C, T)
        no_sp = block_cost(layer, Mode(tp=t), devices, C, replace(T, sequence_parallel=False))
        assert sp.act_bytes == pytest.approx(34 / t) and no_sp.act_bytes == pytest.approx(10 + 24 / t)
        # reduce-scatter + all-gather move what the all-reduce moves on a ring: the same time
        assert sp.F == no_sp.F and sp.I == no_sp.I


def test_context_ring_is_hidden_behind_enough_attention():
    from opsched.cost.collectives import context_ring_time

    attn = Block(0, "attn", ("layers.0",), (), attention_kv_bytes=4e9)
    fast = context_ring_time(attn, tp=1, cp=4, attention_time=100.0, bandwidth=1e9, latency=1e-5)
    assert fast.forward == fast.backward == 0.0 and fast.total_forward == pytest.approx(3 * (1e-5 + 1.0))
    slow = context_ring_time(attn, tp=2, cp=4, attention_time=0.0, bandwidth=1e9, latency=0.0)
    assert slow.forward == pytest.approx(3 * 0.5) and slow.backward == pytest.approx(2 * slow.forward)
    assert context_ring_time(attn, tp=1, cp=1, attention_time=0.0, bandwidth=1e9, latency=0.0).total_backward == 0.0


def attention_layer(kv: float, attention_flops: float = 2e12) -> Block:
    """A layer with weights and an attention core whose keys and values are ``kv`` bytes a microbatch."""
    return Block(0, "layer", ("layers.0",), (), flops=4 * attention_flops, matmul_flops=2 * attention_flops,
                 attention_flops=attention_flops, param_count=10**6, output_bytes=1e8, saved_bytes=4e8,
                 tp_comm_bytes=1e8, attention_kv_bytes=kv)


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2]), cp=st.sampled_from([2, 4]), kv=st.floats(0.0, 4e10),
       attention=st.floats(1e9, 1e14), recompute=st.sampled_from(["none", "selective", "full"]))
def test_a_context_parallel_mode_costs_what_evaluate_costs(tp, cp, kv, attention, recompute):
    """Issue 45: the planner's cpN mode pays the K/V ring by the rule `opsched evaluate` uses for a
    Megatron-style layout with --context-parallel-size (plan.chunk_cost._block_share), to the same figures."""
    from opsched.cost.parallel_layout import ParallelLayout
    from opsched.plan.chunk_cost import _block_share, _ChunkLinks, _rank_devices

    training = replace(T, recompute=recompute)
    b = attention_layer(kv, attention)
    layout = ParallelLayout(tp=tp, pp=1, cp=cp, dp=1, zero=0, recompute=recompute)
    groups = _rank_devices(layout, tp * cp, 0)
    theirs = _block_share(b, b.output_bytes, 0.0, layout, groups, _ChunkLinks.of(groups, layout, C), C, training).cost
    ours = block_cost(b, Mode(tp=tp, cp=cp), tuple(range(tp * cp)), C, training, token_bytes=b.output_bytes)
    for field in ("F", "I", "W", "f_comm", "i_comm", "param_bytes", "act_bytes"):
        assert getattr(ours, field) == pytest.approx(getattr(theirs, field), rel=1e-12), field
    # the ring only adds: never cheaper than replicas taking whole sequences on the same devices
    whole = block_cost(b, Mode(tp=tp, dp=cp), tuple(range(tp * cp)), C, training, token_bytes=b.output_bytes)
    assert ours.F >= whole.F and ours.I >= whole.I and (kv > 0 or ours == whole)


def test_an_expert_parallel_block_pays_the_ring_when_its_attention_splits_sequences():
    """ep8 runs a block's attention data-parallel over 8 ranks: a microbatch of 1 sequence is split 8 ways (a ring
    of 8), of 2 sequences 4 ways, of 8 sequences not at all."""
    from opsched.cost.blocks import sequence_ring

    b = replace(attention_layer(4e10), name="layers.0/experts", scope=("layers.0", "experts.0"),
                ops=tuple(f"layers.0/experts.{e}/w" for e in range(8)))
    devices = tuple(range(8))
    cost = {n: block_cost(b, Mode(ep=8), devices, C, replace(T, microbatch_size=n)) for n in (1, 2, 8)}
    assert cost[1].F > cost[2].F > cost[8].F
    for n, ranks in ((1, 8), (2, 4)):
        ring = sequence_ring(b, 1, ranks, 8, devices[:ranks], C, T)
        assert cost[n].F == pytest.approx(cost[8].F + ring.forward)
        assert cost[n].I == pytest.approx(cost[8].I + ring.backward)


def test_modes_split_sequences_by_context_parallelism_only_when_asked():
    b = block()
    for group, samples in ((8, 1), (8, 2), (6, 4), (12, 3)):
        loose = modes_for(b, group, samples, context=True)
        assert [m.tp for m in loose] == [t for t in range(1, group + 1) if group % t == 0]
        assert all(m.size == group and samples % m.dp == 0 for m in loose)
        assert all(m.cp == 1 for m in modes_for(b, group, samples))


def test_attention_under_fp8_runs_at_the_bf16_rate_on_presets_too():
    """FP8 recipes keep the attention core in BF16 (Transformer Engine: FP8 dot-product attention is off by
    default, ``fp8_dpa=False``): only the other FLOPs take the FP8 peak, with or without efficiencies by kind."""
    from opsched.cost.cluster import preset
    from opsched.cost.blocks import attention_core_time, compute_time

    for h100 in (preset("h100-sxm"), cluster_from_dict(ONE_ROOFLINE)):
        attention = Block(0, "attn", (), (), flops=4e12, attention_flops=3e12)
        on_attention = h100.attention_efficiency or h100.efficiency
        bf16_attention, fp8_rest = 3e12 / (on_attention * 989e12), 1e12 / (h100.efficiency * 1979e12)
        assert compute_time(attention, 1, h100, "fp8") == pytest.approx(bf16_attention + fp8_rest)
        # the whole block at the FP8 rate would be about half as long: the test fails if attention took the FP8 peak
        assert compute_time(attention, 1, h100, "fp8") > 1.5 * 4e12 / (on_attention * 1979e12)
        assert compute_time(attention, 2, h100, "fp8") == pytest.approx((bf16_attention + fp8_rest) / 2)
        # selective recomputation's re-run attention is costed the same way
        assert attention_core_time(attention, 1, h100, "fp8") == pytest.approx(bf16_attention)
        # BF16: the attention at its BF16 rate, the rest at the BF16 peak
        assert compute_time(attention, 1, h100, "bf16") == pytest.approx(
            3e12 / (on_attention * 989e12) + 1e12 / (h100.efficiency * 989e12))


def test_matmuls_pay_their_tile_padding():
    """A block's matmuls are charged their tile-padded FLOPs (opsched.model.gemm), with and without efficiencies by kind."""
    from opsched.cost.cluster import preset
    from opsched.cost.blocks import compute_time

    one = cluster_from_dict(ONE_ROOFLINE)
    kinds = cluster_from_dict({"preset": "h100-sxm", "devices": 8, "matmul_efficiency": {"bf16": 0.8}})
    exact = Block(0, "mlp", (), (), flops=5e12, matmul_flops=4e12)
    padded = Block(0, "mlp", (), (), flops=5e12, matmul_flops=4e12, matmul_padded_flops=8e12)
    assert compute_time(exact, 1, one, "bf16") == pytest.approx(5e12 / (0.5 * 989e12))
    assert compute_time(padded, 1, one, "bf16") == pytest.approx(9e12 / (0.5 * 989e12))
    assert compute_time(padded, 1, kinds, "bf16") == pytest.approx(8e12 / (0.8 * 989e12) + 1e12 / (0.5 * 989e12))
    assert compute_time(padded, 1, preset("h100-sxm"), "bf16") > compute_time(exact, 1, preset("h100-sxm"), "bf16")


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("tp_bytes", [1e7, 1e9, 2e10])  # communication far below, near and far above the compute
def test_tp_comm_overlap_takes_the_longer_of_compute_and_tensor_parallel_traffic_per_pass(recompute, tp_bytes):
    """Megatron's --tp-comm-overlap in the per-block cost every plan uses: each pass takes max(compute, tp
    traffic), never more than exposed and never less than either; W (no collective) and memory are unchanged;
    without sequence parallelism (Megatron requires it) nothing changes."""
    b = block(tp_bytes=tp_bytes)
    devs = (0, 1, 2, 3)
    exposed = block_cost(b, Mode(tp=4), devs, C, Training(microbatches=4, recompute=recompute))
    hidden = block_cost(b, Mode(tp=4), devs, C, Training(microbatches=4, recompute=recompute, tp_comm_overlap=True))
    compute_f = exposed.F - exposed.f_comm
    assert hidden.F == pytest.approx(max(compute_f, exposed.f_comm))
    assert hidden.F <= exposed.F and hidden.I <= exposed.I and hidden.W == exposed.W
    rerun_comm = exposed.f_comm if exposed.rerun_forward else 0.0  # the recomputed forward's collectives hide too
    assert hidden.I >= exposed.I - exposed.i_comm - rerun_comm - 1e-15
    assert (hidden.act_bytes, hidden.param_bytes) == (exposed.act_bytes, exposed.param_bytes)
    no_sp = Training(microbatches=4, recompute=recompute, tp_comm_overlap=True, sequence_parallel=False)
    assert block_cost(b, Mode(tp=4), devs, C, no_sp).F == block_cost(
        b, Mode(tp=4), devs, C, Training(microbatches=4, recompute=recompute, sequence_parallel=False)).F
    one = block_cost(b, Mode(dp=4), devs, C, Training(microbatches=4, recompute=recompute, tp_comm_overlap=True))
    assert one == block_cost(b, Mode(dp=4), devs, C, Training(microbatches=4, recompute=recompute))


def test_unfused_attention_writes_its_scores_and_runs_its_multiplies_as_gemms():
    """attention="unfused" (Megatron-LM before FlashAttention) costs a fused Attention op as its kernels: the two
    batched GEMMs at the matmul rate on their padded FLOPs, the scores' 13 bytes a score (16-bit) at the memory
    rate; the rest of the block is costed as with a fused attention."""
    from dataclasses import replace

    from opsched.cost.cluster import preset
    from opsched.cost.blocks import compute_time, unfused_attention_time

    a100, scores = preset("a100-80g"), 1e9
    gemm = 2 * scores * 2 * 96  # Q·Kᵀ and scores·V with head dims 96: padded to 128 in the tile
    layer = Block(0, "layer", ("layers.0",), (), flops=20e12, io_bytes=3e9, matmul_flops=19e12, matmul_io_bytes=2e9,
                  attention_flops=gemm + 6 * scores, attention_io_bytes=1e8, attention_scores=scores,
                  attention_gemm_padded_flops=gemm * 128 / 96, param_count=10, output_bytes=1e9, saved_bytes=1e9)
    bandwidth = a100.memory_bandwidth * a100.memory_efficiency
    expected = gemm * 128 / 96 / a100.matmul_flops_per_second("bf16") + (13 * scores + 1e8) / bandwidth
    assert unfused_attention_time(layer, 1, a100, "bf16") == pytest.approx(expected)
    fused_attention = max(layer.attention_flops / a100.attention_flops_per_second("bf16"), 1e8 / bandwidth)
    fused, unfused = compute_time(layer, 1, a100, "bf16"), compute_time(layer, 1, a100, "bf16", "unfused")
    assert unfused - fused == pytest.approx(expected - fused_attention)
    assert compute_time(layer, 4, a100, "bf16", "unfused") == pytest.approx(unfused / 4)
    # FP32 scores take 4 bytes: 6 x 4 + 1 a score
    assert unfused_attention_time(layer, 1, a100, "fp32") > unfused_attention_time(layer, 1, a100, "bf16")
    # an attention exported as its MatMul / Softmax chain has no score count: its ops carry their traffic already
    chain = replace(layer, attention_scores=0.0, attention_gemm_padded_flops=0.0)
    assert compute_time(chain, 1, a100, "bf16", "unfused") == compute_time(chain, 1, a100, "bf16")
    # FP8 recipes keep attention in BF16: the GEMMs at the BF16 matmul rate, not FP8's
    h100 = preset("h100-sxm")
    assert unfused_attention_time(layer, 1, h100, "fp8") == pytest.approx(unfused_attention_time(layer, 1, h100, "bf16"))
    # one roofline (no efficiencies by kind): the GEMMs at the one efficiency, the traffic at the full bandwidth
    one = cluster_from_dict(ONE_ROOFLINE)
    assert unfused_attention_time(layer, 1, one, "bf16") == pytest.approx(
        gemm * 128 / 96 / (0.5 * 989e12) + (13 * scores + 1e8) / one.memory_bandwidth)


def test_unfused_attention_keeps_its_scores_unless_recomputed():
    from dataclasses import replace

    from opsched.cost.cluster import preset
    from opsched.cost.blocks import attention_core_time

    a100 = preset("a100-80g", 8)
    layer = Block(0, "layer", ("layers.0",), (), flops=20e12, matmul_flops=19e12, attention_flops=4e11,
                  attention_scores=1e9, attention_gemm_padded_flops=4e11, param_count=10, output_bytes=1e9,
                  saved_bytes=2e9)
    devices = (0, 1)
    for recompute in ("none", "selective", "full"):
        t = replace(T, recompute=recompute)
        fused = block_cost(layer, Mode(tp=2), devices, a100, t, token_bytes=1e9)
        unfused = block_cost(layer, Mode(tp=2), devices, a100, replace(t, attention="unfused"), token_bytes=1e9)
        assert unfused.F > fused.F and unfused.I > fused.I and unfused.W > fused.W
        # softmax output, dropout mask and output: 5 bytes a score, split over the 2 ranks; none kept when
        # recomputed (selective re-runs the unfused core, full the whole forward)
        extra = 5e9 / 2 if recompute == "none" else 0.0
        assert unfused.act_bytes == pytest.approx(fused.act_bytes + extra)
    selective = block_cost(layer, Mode(tp=2), devices, a100, replace(T, recompute="selective", attention="unfused"))
    plain = block_cost(layer, Mode(tp=2), devices, a100, replace(T, attention="unfused"))
    assert selective.I == pytest.approx(plain.I + attention_core_time(layer, 2, a100, "bf16", "unfused"))
    assert attention_core_time(layer, 2, a100, "bf16", "unfused") > attention_core_time(layer, 2, a100, "bf16")
    with pytest.raises(OpschedError, match="attention must be one of fused, unfused"):
        Training(attention="flash")
