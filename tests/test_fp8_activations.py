"""FP8 activation caching (issue 43 item 5): under ``--dtype fp8`` the inputs a linear layer keeps for its weight
gradient are stored in FP8, one byte an element.

Transformer Engine's ``Linear`` keeps the quantized input it ran its FP8 GEMM with (only its column-wise copy) for
the weight-gradient GEMM (NVIDIA/TransformerEngine ``transformer_engine/pytorch/module/linear.py``), and DeepSeek-V3
caches the activations feeding its FP8 linear layers in FP8 (arXiv 2412.19437 §3.3). What other operators keep (a
norm's input, the SwiGLU product's operands, the attention's Q, K and V) stays in its own type.
"""

from __future__ import annotations

import onnx
import pytest
from test_models import load_build

from opsched.cost.blocks import Mode, block_cost, recomputed_parts
from opsched.cost.cluster import Training, preset
from opsched.model.coarsen import coarsen
from opsched.model.onnx_import import import_onnx
from opsched.model.recompute_modules import part_costs


def _mlp_model(tmp_path):
    """Embedding, an RMSNorm, a SwiGLU MLP (gate, up, SiLU, product, down) and a head, in bf16."""
    build = load_build()
    b = build.GraphBuilder("tiny_swiglu")
    dim, ff, vocab = 64, 96, 97
    ids = b.data("input_ids", ["batch", "seq"], onnx.TensorProto.INT64)
    h = build.embedding(b, "model/embed_tokens", ids, vocab, dim)
    x = build.rms_norm(b, "model/layers.0/post_attention_layernorm", h, dim)
    x = b.node("model/layers.0", "Add", [h, build.swiglu_mlp(b, "model/layers.0/mlp", x, dim, ff)])
    b.output(build.linear(b, "lm_head", x, dim, vocab), "logits", ["batch", "seq", vocab])
    path = tmp_path / "swiglu.onnx"
    onnx.save(b.model({"batch": 2, "seq": 32}, "test model"), path)
    return import_onnx(path)


def test_a_weight_matmul_marks_half_its_kept_bf16_input_and_no_other_operator_does(tmp_path):
    g = _mlp_model(tmp_path)
    ops = [d["op"] for _, d in g.nodes(data=True)]
    linear = [op for op in ops if op.op_type == "MatMul" and op.param_count]
    # gate, up (its input kept once, by gate), down, head
    assert len(linear) == 4 and [op.saved_bytes > 0 for op in linear] == [True, False, True, True]
    for op in linear:
        assert op.fp8_input_saving == pytest.approx(op.saved_bytes / 2)  # 2 bytes an element -> 1
    others = [op for op in ops if not (op.op_type == "MatMul" and op.param_count)]
    assert any(op.saved_bytes > 0 for op in others)  # the norm and the SwiGLU product keep theirs ...
    assert all(op.fp8_input_saving == 0 for op in others)  # ... in bf16


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_stores_the_linear_inputs_in_one_byte_and_nothing_else_changes(tmp_path, tp):
    bg = coarsen(_mlp_model(tmp_path))
    cluster = preset("h100-sxm", tp)
    saved_total = freed_total = 0.0
    for b in bg:
        block = bg.nodes[b]["block"]
        mode = Mode(tp=tp)
        bf16 = block_cost(block, mode, tuple(range(tp)), cluster, Training(sequence_parallel=True))
        fp8 = block_cost(block, mode, tuple(range(tp)), cluster, Training(dtype="fp8", sequence_parallel=True))
        assert bf16.act_bytes - fp8.act_bytes == pytest.approx(block.fp8_input_saving / tp)
        saved_total += bf16.act_bytes
        freed_total += bf16.act_bytes - fp8.act_bytes
    assert 0 < freed_total < saved_total / 2  # the linear inputs halve; the rest stays


def test_a_recomputed_module_frees_what_it_kept_as_it_kept_it(tmp_path):
    """Recomputing the MLP under fp8 frees its linear inputs at one byte an element: no more than fp8 stored."""
    g = _mlp_model(tmp_path)
    (mlp,) = [p for p in part_costs([d["op"] for _, d in g.nodes(data=True)]) if p.part == "mlp"]
    assert 0 < mlp.fp8_input_saving < mlp.saved_bytes
    bg = coarsen(g)
    cluster = preset("h100-sxm")
    for b in bg:
        block = bg.nodes[b]["block"]
        _, bf16 = recomputed_parts(block, frozenset({"mlp"}), 1, cluster, Training())
        _, fp8 = recomputed_parts(block, frozenset({"mlp"}), 1, cluster, Training(dtype="fp8"))
        mine = sum(p.fp8_input_saving for p in block.parts if p.part == "mlp")
        assert bf16 - fp8 == pytest.approx(mine)
        recomputed = block_cost(block, Mode(), (0,), cluster, Training(dtype="fp8", recompute_modules=("mlp",)))
        assert recomputed.act_bytes >= 0
