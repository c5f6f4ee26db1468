"""Recomputing multi-latent attention's up-projections (``recompute_modules=mla_up_proj``) frees what they made.

Megatron-Core's MLA checkpoints the up-projections without their output: the
latents (the checkpoint's inputs) stay, and the queries, keys and values they
made are discarded once the core attention has run, then made again in the
backward (``qkv_up_checkpoint.discard_output_and_register_recompute``). So
what the recomputation frees is the attention's saved Q, K and V, not the
up-projections' own saved inputs.
"""

from __future__ import annotations

import onnx
import pytest
from test_models import load_build

from opsched.cost.blocks import Mode, recomputed_parts, stored_activation_bytes
from opsched.cost.cluster import Training, preset
from opsched.model.coarsen import coarsen
from opsched.model.onnx_import import import_onnx
from opsched.model.recompute_modules import part_costs


def _one_layer(tmp_path, mla: bool):
    """Embedding, one attention (MLA or plain multi-head) and a head: the least that has the rule in it."""
    build = load_build()
    b = build.GraphBuilder("tiny_mla" if mla else "tiny_mha")
    dim, vocab = 64, 97
    ids = b.data("input_ids", ["batch", "seq"], onnx.TensorProto.INT64)
    h = build.embedding(b, "model/embed_tokens", ids, vocab, dim)
    scope = "model/layers.0/self_attn"
    if mla:
        a = build.mla_attention(b, scope, h, dim, 4, q_rank=24, kv_rank=16, nope_dim=8, rope_dim=4, v_dim=8)
    else:
        q, k, v = (build.linear(b, f"{scope}/{p}_proj", h, dim, dim) for p in "qkv")
        a = build.linear(b, f"{scope}/o_proj", b.node(scope, "Attention", [q, k, v], q_num_heads=4, kv_num_heads=4),
                         dim, dim)
    x = b.node("model/layers.0", "Add", [h, a])
    b.output(build.linear(b, "lm_head", x, dim, vocab), "logits", ["batch", "seq", vocab])
    path = tmp_path / f"{'mla' if mla else 'mha'}.onnx"
    onnx.save(b.model({"batch": 2, "seq": 32}, "test model"), path)
    return import_onnx(path)


def _attention(g):
    (op,) = [d["op"] for _, d in g.nodes(data=True) if d["op"].op_type == "Attention"]
    return op


def test_mla_attention_marks_the_queries_keys_and_values_its_up_projections_made(tmp_path):
    op = _attention(_one_layer(tmp_path, mla=True))
    batch, seq, heads = 2, 32, 4
    elem = 2  # bf16
    q = batch * seq * heads * (8 + 4) * elem
    k = q  # keys: each head's own 8 and the shared 4 (concatenated: their own storage)
    kv = batch * seq * heads * (8 + 8) * elem  # the up-projection's output, which the values are a view of
    o = batch * seq * heads * 8 * elem
    assert op.mla_qkv_saved_bytes == q + k + kv
    assert op.saved_bytes == pytest.approx(q + k + kv + o)
    assert _attention(_one_layer(tmp_path, mla=False)).mla_qkv_saved_bytes == 0  # no up-projection: nothing marked


def test_recomputing_mla_up_proj_frees_the_attentions_qkv_and_keeps_the_latents(tmp_path):
    g = _one_layer(tmp_path, mla=True)
    op = _attention(g)
    parts = {p.part: p for p in part_costs([d["op"] for _, d in g.nodes(data=True)])}
    assert parts["mla_up_proj"].saved_bytes == op.mla_qkv_saved_bytes
    assert parts["core_attn"].saved_bytes == op.saved_bytes - op.mla_qkv_saved_bytes
    assert parts["mla_up_proj"].matmul_flops > 0  # the up-projections' forward runs again
    bg = coarsen(g)
    cluster, training = preset("h100-sxm"), Training()
    freed = sum(recomputed_parts(bg.nodes[b]["block"], frozenset({"mla_up_proj"}), 1, cluster, training)[1]
                for b in bg)
    assert freed == op.mla_qkv_saved_bytes
    stored = sum(stored_activation_bytes(bg.nodes[b]["block"], Mode()) for b in bg)
    assert 0 < stored - freed < stored  # the latents and the rest stay


def test_a_plain_attention_frees_nothing_under_mla_up_proj(tmp_path):
    bg = coarsen(_one_layer(tmp_path, mla=False))
    cluster, training = preset("h100-sxm"), Training()
    assert all(recomputed_parts(bg.nodes[b]["block"], frozenset({"mla_up_proj"}), 1, cluster, training) == (0.0, 0.0)
               for b in bg)
