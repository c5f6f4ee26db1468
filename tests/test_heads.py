"""Tensor parallelism splits attention heads: a tp degree must divide the query and the key-value heads.

Megatron-Core divides ``num_attention_heads`` and ``num_query_groups`` over the
tensor-parallel ranks (and refuses otherwise), so a plan or a layout whose tp
does not divide them is one no runtime accepts. The import finds the heads
(a fused ``Attention`` op's shapes and attributes, and transformers'
``repeat_kv`` before it), the upper level's modes and the Megatron-style layout
search keep to them, and ``evaluate`` refuses a layout that does not.
"""

from __future__ import annotations

import json
import math

import onnx
import pytest
from onnx import TensorProto, helper

from opsched.cli import main
from opsched.cost.blocks import modes_for
from opsched.model.coarsen import coarsen
from opsched.model.onnx_import import import_onnx
from opsched.plan.layout_search import layout_grid
from opsched.plan.layouts import model_index
from tests.test_models import load_build

build = load_build()


def grouped_query_model(path, heads: int = 12, kv_heads: int = 4, layers: int = 2, dim: int = 96) -> str:
    """A small Llama-like decoder (models/build.py) with ``heads`` query and ``kv_heads`` key-value heads."""
    b = build.GraphBuilder("gqa")
    ids = b.data("input_ids", ["batch", "seq"], build.I64)
    h = build.embedding(b, "model/embed_tokens", ids, 128, dim)
    logits = build.decoder_lm(b, "model", h, layers=layers, dim=dim, heads=heads, kv_heads=kv_heads, vocab=128,
                              mlp_fn=build.dense_mlp(dim, 2 * dim))
    b.output(logits, "logits", ["batch", "seq", 128])
    onnx.save(b.model({"batch": 1, "seq": 64}, "grouped-query test model"), str(path))
    return str(path)


def repeat_kv_model(path, heads: int = 6, kv_heads: int = 2, head_dim: int = 4, seq: int = 8) -> str:
    """Keys and values repeated from ``kv_heads`` to ``heads`` before a 4-d Attention, as transformers exports
    grouped-query attention (``repeat_kv``: Unsqueeze, Expand to 5-d, Reshape)."""
    dim = heads * head_dim
    nodes, inits = [], []

    def const(name, values):
        inits.append(helper.make_tensor(name, TensorProto.INT64, [len(values)], values))
        return name

    def weight(name, cols):
        inits.append(helper.make_tensor(name, TensorProto.FLOAT, [dim, cols], [0.0] * (dim * cols)))
        return name

    def heads_of(x, name, n, repeat):
        nodes.append(helper.make_node("MatMul", [x, weight(f"w_{name}", n * head_dim)], [f"{name}_flat"]))
        nodes.append(helper.make_node("Reshape", [f"{name}_flat", const(f"s_{name}", [1, seq, n, head_dim])],
                                      [f"{name}_bshd"]))
        nodes.append(helper.make_node("Transpose", [f"{name}_bshd"], [f"{name}_bhsd"], perm=[0, 2, 1, 3]))
        if not repeat:
            return f"{name}_bhsd"
        nodes.append(helper.make_node("Unsqueeze", [f"{name}_bhsd", const(f"a_{name}", [2])], [f"{name}_5d"]))
        nodes.append(helper.make_node("Expand", [f"{name}_5d", const(f"e_{name}", [1, n, heads // n, seq, head_dim])],
                                      [f"{name}_rep"]))
        nodes.append(helper.make_node("Reshape", [f"{name}_rep", const(f"r_{name}", [1, heads, seq, head_dim])],
                                      [f"{name}_heads"]))
        return f"{name}_heads"

    q, k, v = heads_of("x", "q", heads, False), heads_of("x", "k", kv_heads, True), heads_of("x", "v", kv_heads, True)
    nodes.append(helper.make_node("Attention", [q, k, v], ["attn"]))
    graph = helper.make_graph(nodes, "repeat_kv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, dim])],
                              [helper.make_tensor_value_info("attn", TensorProto.FLOAT, None)], initializer=inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), str(path))
    return str(path)


def attention_heads(model: str) -> set[int]:
    g = import_onnx(model)
    return {d["op"].attention_heads for _, d in g.nodes(data=True) if d["op"].op_type == "Attention"}


@pytest.mark.parametrize("heads, kv_heads, expected", [(6, 2, 2), (6, 6, 6), (8, 6, 2)])
def test_repeated_keys_count_the_heads_before_the_repeat(tmp_path, heads, kv_heads, expected):
    if heads % kv_heads:  # grouped-query attention needs kv_heads | heads: the repeat cannot be written
        pytest.skip("not a grouped-query layout")
    assert attention_heads(repeat_kv_model(tmp_path / "m.onnx", heads, kv_heads)) == {expected}


@pytest.mark.parametrize("heads, kv_heads", [(12, 4), (12, 12), (10, 2)])
def test_fused_attention_attributes_give_the_common_divisor(tmp_path, heads, kv_heads):
    model = grouped_query_model(tmp_path / "m.onnx", heads, kv_heads, dim=heads * 8)
    assert attention_heads(model) == {math.gcd(heads, kv_heads)}


def test_no_mode_or_layout_splits_heads_unevenly(tmp_path):
    """Every block's modes on groups of 1-16 devices keep tp dividing its heads, and stay non-empty (a split that
    can neither divide the heads nor leave whole sequences becomes context parallelism); the layout grid too."""
    bg = coarsen(import_onnx(grouped_query_model(tmp_path / "m.onnx", 12, 4)))
    heads = model_index(bg).heads
    assert heads == 4
    for b in bg.nodes:
        block = bg.nodes[b]["block"]
        for group in range(1, 17):
            for samples in (None, 1, 2, 8):
                modes = modes_for(block, group, samples)
                assert modes, (block.name, group, samples)
                assert all(not block.attention_heads or block.attention_heads % m.tp == 0 for m in modes), \
                    (block.name, group, samples, [str(m) for m in modes])
                assert all(m.tp * m.cp * m.dp * m.ep == group for m in modes)
    assert {lay.tp for lay in layout_grid(32, 8, layers=2, experts=0, heads=heads)} == {1, 2, 4}


def test_evaluate_refuses_tp_that_does_not_divide_the_heads(tmp_path, capsys):
    model = grouped_query_model(tmp_path / "m.onnx", 12, 4)
    code = main(["evaluate", model, "--devices", "8", "--layout", "tp=8", "--global-batch", "8"])
    out = capsys.readouterr().err
    err = [line for line in out.splitlines() if line.startswith("opsched: error:")]
    assert code == 2 and len(err) == 1 and "Traceback" not in out, out
    assert "tp=8 does not divide the attention heads" in err[0] and "use tp=1, 2, 4" in err[0], err
    assert main(["evaluate", model, "--devices", "8", "--layout", "tp=4", "--global-batch", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["tp"] == 4
