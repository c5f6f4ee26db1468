"""What DeepSeek-V3 stores of a MoE layer (arXiv 2412.19437 §3.3.3): the SwiGLU's inputs cached (in FP8 under
``--dtype fp8``) and its output recomputed (Megatron-Core's ``moe_act``), and the input of the linear layer after
the attention kept in E5M6 (12 bits) under ``--dtype fp8``.

The bytes each rule should free are counted here from the operators themselves (what the activation's operators
keep, what the down projections keep, what the gate and up projections write), not from the marks the import sets.
"""

from __future__ import annotations

import onnx
import pytest
from test_models import load_build

from opsched.cost.blocks import Mode, block_cost
from opsched.cost.cluster import Training, preset
from opsched.model.coarsen import coarsen
from opsched.model.onnx_import import import_onnx
from opsched.model.recompute_modules import module_part

DIM, FF, EXPERTS, TOP_K, HEADS = 64, 96, 4, 2, 4


def _moe_model(tmp_path):
    """Embedding, an attention, a routed MoE layer of SwiGLU experts and a head, in bf16."""
    build = load_build()
    b = build.GraphBuilder("tiny_moe")
    ids = b.data("input_ids", ["batch", "seq"], onnx.TensorProto.INT64)
    h = build.embedding(b, "model/embed_tokens", ids, 97, DIM)
    x = build.rms_norm(b, "model/layers.0/input_layernorm", h, DIM)
    h = b.node("model/layers.0", "Add", [h, build.attention(b, "model/layers.0/self_attn", x, DIM, HEADS)])
    x = build.rms_norm(b, "model/layers.0/post_attention_layernorm", h, DIM)

    def expert(b, scope, t):
        return build.swiglu_mlp(b, scope, t, DIM, FF)

    h = build.moe_layer(b, "model/layers.0/mlp", x, h, DIM, EXPERTS, TOP_K, expert)
    b.output(build.linear(b, "lm_head", h, DIM, 97), "logits", ["batch", "seq", 97])
    path = tmp_path / "moe.onnx"
    onnx.save(b.model({"batch": 2, "seq": 32}, "test model"), path)
    return import_onnx(path)


def _stored(bg, training: Training) -> float:
    cluster = preset("h100-sxm")
    return sum(block_cost(bg.nodes[b]["block"], Mode(), (0,), cluster, training).act_bytes for b in bg)


def _expert_matmuls(ops, name: str):
    return [op for op in ops if op.op_type == "MatMul" and name in op.scope and module_part(op) == "moe_experts"]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_recomputing_the_swiglu_keeps_its_inputs_and_frees_what_it_and_the_down_projection_kept(tmp_path, dtype):
    g = _moe_model(tmp_path)
    ops = [d["op"] for _, d in g.nodes(data=True)]
    activation = sum(op.saved_bytes for op in ops if module_part(op) == "moe_act")  # SiLU's x, silu(x), up
    down = sum(op.saved_bytes for op in _expert_matmuls(ops, "down_proj"))  # the SwiGLU's output, in bf16
    inputs = sum(op.output_bytes for name in ("gate_proj", "up_proj") for op in _expert_matmuls(ops, name))
    assert activation > 0 and down > 0 and inputs > 0
    byte = 0.5 if dtype == "fp8" else 1.0  # an FP8 element in place of a bf16 one
    bg = coarsen(g)
    freed = _stored(bg, Training(dtype=dtype)) - _stored(bg, Training(dtype=dtype, recompute_modules=("moe_act",)))
    # the activation's operators keep theirs in bf16; the down projection keeps its input in FP8 under fp8; the
    # checkpoint keeps the gate and up projections' outputs (in FP8 under fp8, DeepSeek-V3 §3.3.3 (2))
    assert freed == pytest.approx(activation + down * byte - inputs * byte)


def test_recomputing_the_whole_moe_keeps_no_swiglu_input_it_makes_again(tmp_path):
    """``moe`` recomputes the expert projections too: the SwiGLU's inputs are made again, not kept."""
    g = _moe_model(tmp_path)
    ops = [d["op"] for _, d in g.nodes(data=True)]
    down = sum(op.saved_bytes for op in _expert_matmuls(ops, "down_proj"))
    inputs = sum(op.output_bytes for name in ("gate_proj", "up_proj") for op in _expert_matmuls(ops, name))
    experts = sum(op.saved_bytes for op in ops if module_part(op) == "moe_experts")  # routed rows, down's input...
    bg = coarsen(g)
    act = _stored(bg, Training(recompute_modules=("moe_act",)))
    moe = _stored(bg, Training(recompute_modules=("moe",)))
    assert act - moe == pytest.approx(experts - down + inputs)


def test_fp8_keeps_the_attention_output_read_by_the_linear_after_it_in_e5m6(tmp_path):
    g = _moe_model(tmp_path)
    (attention,) = [d["op"] for _, d in g.nodes(data=True) if d["op"].op_type == "Attention"]
    out = attention.output_bytes  # kept by the attention for its backward, read by o_proj
    assert attention.fp8_input_saving == pytest.approx(out * (1 - 1.5 / 2))  # 12 bits in place of 16
    bg = coarsen(g)
    (block,) = [bg.nodes[b]["block"] for b in bg if "Attention" in bg.nodes[b]["block"].op_types]
    cluster = preset("h100-sxm")
    bf16 = block_cost(block, Mode(), (0,), cluster, Training()).act_bytes
    fp8 = block_cost(block, Mode(), (0,), cluster, Training(dtype="fp8")).act_bytes
    assert bf16 - fp8 == pytest.approx(block.fp8_input_saving)
    assert bf16 - fp8 >= out / 4


def test_recomputing_mlp_frees_nothing_of_a_moe_layer(tmp_path):
    """Megatron-Core's ``mlp`` module recomputes a dense MLP: on a MoE layer (the router, the experts, the routing
    weights' multiply of the combine) it frees nothing, where ``moe`` frees everything the layer's MLP kept."""
    g = _moe_model(tmp_path)
    ops = [d["op"] for _, d in g.nodes(data=True)]
    assert not [op for op in ops if module_part(op) == "mlp"]
    glue = [op for op in ops if op.in_moe_layer and op.saved_bytes]  # in the MoE layer's scope, outside an expert
    assert glue and all(module_part(op) == "moe_experts" for op in glue)
    bg = coarsen(g)
    assert _stored(bg, Training(recompute_modules=("mlp",))) == _stored(bg, Training())
