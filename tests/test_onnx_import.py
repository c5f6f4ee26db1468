"""ONNX import: FLOP formulas, parameters, dims, MoE routing, scopes, both torch exporters."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from helpers import REPO, make_moe_model, moe_param_count, real_export, save
from opsched.errors import OpschedError
from opsched.model.graph import ops, totals
from opsched.model.onnx_dims import parse_dims
from opsched.model.onnx_import import import_onnx, node_scope


def _single_op_model(op, inputs, out_shape=None, opset=23, weights=(), **attrs):
    """One node; ``inputs`` is a list of (name, shape, dtype); ``weights`` names become initializers."""
    vis, inits = [], []
    for name, shape, dtype in inputs:
        if name in weights:
            inits.append(helper.make_tensor(name, dtype, shape, np.zeros(int(np.prod(shape)), np.float32).tolist()))
        else:
            vis.append(helper.make_tensor_value_info(name, dtype, shape))
    node = helper.make_node(op, [i[0] for i in inputs], ["y"], name="op", **attrs)
    graph = helper.make_graph([node], "one", vis, [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _flops_of(tmp_path, model):
    g = import_onnx(save(model, tmp_path / "m.onnx"))
    return g.nodes["op"]["op"].flops, g


F = TensorProto.FLOAT


def test_matmul_and_gemm_flops_equal_hand_computation(tmp_path):
    # x[4,8] @ W1[8,16] -> Gemm(transB, bias) with W2[32,16] -> [4,32]
    x = helper.make_tensor_value_info("x", F, [4, 8])
    w1 = helper.make_tensor_value_info("w1", F, [8, 16])
    w2 = helper.make_tensor_value_info("w2", F, [32, 16])
    bias = helper.make_tensor_value_info("b", F, [32])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm"),
             helper.make_node("Gemm", ["h", "w2", "b"], ["y"], name="gemm", transB=1),
             helper.make_node("Gemm", ["h", "w2"], ["z"], name="gemm_nobias", transB=1)]
    graph = helper.make_graph(nodes, "mm", [x, w1, w2, bias], [helper.make_tensor_value_info("y", F, None),
                                                             helper.make_tensor_value_info("z", F, None)])
    g = import_onnx(save(helper.make_model(graph), tmp_path / "mm.onnx"))
    assert g.nodes["mm"]["op"].flops == 2 * 4 * 8 * 16
    assert g.nodes["gemm"]["op"].flops == 2 * 4 * 16 * 32 + 4 * 32
    assert g.nodes["gemm_nobias"]["op"].flops == 2 * 4 * 16 * 32
    # w1, w2, b are weights (read only as the weight operand), x is data
    assert g.graph["data_inputs"] == ["x"]
    # w2 is read twice: it is a small tensor (512 <= 1024 elements), as exporters deduplicate,
    # so each reader owns a copy
    assert totals(g)["param_count"] == 8 * 16 + 2 * 32 * 16 + 32
    assert g.nodes["gemm_nobias"]["op"].param_count == 32 * 16


def test_batched_matmul_and_transA(tmp_path):
    m = _single_op_model("MatMul", [("a", [3, 5, 7], F), ("b", [3, 7, 2], F)])
    assert _flops_of(tmp_path, m)[0] == 2 * 3 * 5 * 7 * 2
    m = _single_op_model("Gemm", [("a", [7, 5], F), ("b", [7, 2], F)], transA=1)
    assert _flops_of(tmp_path, m)[0] == 2 * 5 * 7 * 2


@pytest.mark.parametrize(
    "op, inputs, attrs, expected",
    [
        # Conv: out [1,8,6,6], weight [8,3,3,3], bias: 2*out*(3*3*3) + out
        ("Conv", [("x", [1, 3, 8, 8], F), ("w", [8, 3, 3, 3], F), ("bias", [8], F)], {},
         2 * (8 * 6 * 6) * 27 + 8 * 6 * 6),
        # grouped conv: weight [8, 1, 3, 3], group 4 (x has 4 channels)
        ("Conv", [("x", [1, 4, 8, 8], F), ("w", [8, 1, 3, 3], F)], {"group": 4}, 2 * (8 * 6 * 6) * 9),
        ("Einsum", [("a", [2, 3, 4], F), ("b", [4, 5], F)], {"equation": "bij,jk->bik"}, 2 * 2 * 3 * 4 * 5),
        ("LayerNormalization", [("x", [2, 5, 6], F), ("s", [6], F), ("bb", [6], F)], {"axis": -1}, 8 * 60),
        ("LayerNormalization", [("x", [2, 5, 6], F), ("s", [6], F)], {"axis": -1}, 7 * 60),
        ("RMSNormalization", [("x", [2, 5, 6], F), ("s", [6], F)], {"axis": -1}, 4 * 60),
        ("Softmax", [("x", [2, 5, 6], F)], {"axis": -1}, 5 * 60),
        ("Add", [("x", [2, 5, 6], F), ("z", [6], F)], {}, 60),
        ("Relu", [("x", [2, 5, 6], F)], {}, 60),
        ("Sigmoid", [("x", [2, 5, 6], F)], {}, 60),
        ("ReduceMean", [("x", [2, 5, 6], F)], {"keepdims": 1}, 60),
        ("ReduceSumSquare", [("x", [2, 5, 6], F)], {}, 120),
        ("Transpose", [("x", [2, 5, 6], F)], {"perm": [2, 1, 0]}, 0),
        ("Reshape", [("x", [2, 5, 6], F), ("shp", [2], TensorProto.INT64)], {}, 0),
    ],
)
def test_flop_formulas(tmp_path, op, inputs, attrs, expected):
    extra = {}
    if op == "Reshape":
        # the target shape must be a constant for shape inference
        model = _single_op_model(op, inputs[:1] + [("shp", [2], TensorProto.INT64)], **attrs)
        model.graph.input.pop()
        model.graph.initializer.append(helper.make_tensor("shp", TensorProto.INT64, [2], [10, 6]))
    else:
        model = _single_op_model(op, inputs, **attrs, **extra)
    flops, g = _flops_of(tmp_path, model)
    assert flops == expected
    assert g.graph["warnings"] == []


def test_attention_opset23_flops(tmp_path):
    b, h, sq, skv, d = 2, 4, 8, 8, 16
    m = _single_op_model("Attention", [("q", [b, h, sq, d], F), ("k", [b, h, skv, d], F), ("v", [b, h, skv, d], F)])
    flops, g = _flops_of(tmp_path, m)
    scores = b * h * sq * skv
    assert flops == 2 * scores * (d + d) + 6 * scores
    # the output shape came from shape inference: [b, h, sq, d] floats
    assert g.nodes["op"]["op"].output_bytes == b * h * sq * d * 4


def test_gather_costs_bytes_only(tmp_path):
    m = _single_op_model("Gather", [("table", [100, 8], F), ("idx", [2, 3], TensorProto.INT64)])
    flops, g = _flops_of(tmp_path, m)
    op = g.nodes["op"]["op"]
    assert flops == 0
    assert op.output_bytes == 2 * 3 * 8 * 4
    assert op.io_bytes == 2 * 3 * 8 * 4 + 2 * 3 * 8 + 2 * 3 * 8 * 4  # the 6 rows read (not the table), indices, output
    # a graph input read only as a Gather table is an embedding: a weight
    assert op.param_count == 800


def test_unknown_op_costs_bytes_and_warns(tmp_path):
    x = helper.make_tensor_value_info("x", F, [4, 4])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("FancyOp", ["r"], ["y"], name="fancy", domain="com.example"),
             helper.make_node("FancyOp", ["y"], ["z"], name="fancy2", domain="com.example")]
    graph = helper.make_graph(nodes, "u", [x], [helper.make_tensor_value_info("z", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.example", 1)])
    g = import_onnx(save(model, tmp_path / "u.onnx"))
    assert g.nodes["fancy"]["op"].flops == 0
    assert g.nodes["fancy"]["op"].io_bytes == 4 * 4 * 4  # its input is known, its output is not
    assert g.nodes["relu"]["op"].flops == 16
    assert any("FancyOp x2" in w for w in g.graph["warnings"])


@pytest.mark.parametrize("routing", ["nonzero", "dense"])
def test_dynamo_and_legacy_forms_give_same_totals(tmp_path, routing):
    dyn = import_onnx(save(make_moe_model("dynamo", routing=routing), tmp_path / "d.onnx"), dims={"batch": 2, "seq": 8})
    leg = import_onnx(save(make_moe_model("legacy", routing=routing), tmp_path / "l.onnx"), dims={"batch": 2, "seq": 8})
    assert dyn.graph["exporter"] == "dynamo" and leg.graph["exporter"] == "legacy"
    td, tl = totals(dyn), totals(leg)
    assert td["param_count"] == tl["param_count"] == moe_param_count()
    assert td["flops"] == tl["flops"] > 0
    assert td["param_bytes"] == tl["param_bytes"] == 4 * moe_param_count()
    # scopes agree: the expert MatMuls of both carry the same module path
    scopes_d = sorted(o.scope for _, o in dyn.nodes(data="op") if o.op_type == "MatMul")
    scopes_l = sorted(o.scope for _, o in leg.nodes(data="op") if o.op_type == "MatMul")
    assert scopes_d == scopes_l
    assert ("layers.1", "mlp", "experts.3", "w2") in scopes_d


@pytest.mark.parametrize("cf", [1.0, 1.25, 3.0])
def test_nonzero_moe_loop_uses_balanced_routing(tmp_path, cf):
    batch, seq, experts, top_k, hidden, ffn = 2, 12, 4, 2, 16, 32
    path = save(make_moe_model("legacy", experts=experts, top_k=top_k, hidden=hidden, ffn=ffn), tmp_path / "m.onnx")
    g = import_onnx(path, dims={"batch": batch, "seq": seq}, capacity_factor=cf)
    tokens = batch * seq
    n = math.ceil(cf * tokens * top_k / experts)
    assert set(g.graph["moe_routing"].values()) == {n}
    w1 = [o for _, o in g.nodes(data="op") if o.scope[-2:] == ("experts.0", "w1")]
    assert len(w1) == 2  # one per layer
    assert all(o.flops == 2 * n * hidden * ffn for o in w1)


def test_a_nonzero_mask_is_not_moe_routing():
    """LLaVA's image-token merge (masked_scatter: Equal -> NonZero -> ScatterND) is a mask, taken as all nonzero."""
    from opsched.model.onnx_import import import_warnings, routing_assumptions

    g = import_onnx(real_export("llava_mask.legacy.onnx"))
    assert g.graph["moe_routing"] == {} and routing_assumptions(g) == []
    assert g.graph["nonzero_masks"] == {"/NonZero": 1 * 10 * 32}  # every element of the [1, 10, 32] mask
    (warning,) = import_warnings(g)
    assert "mask, not expert routing" in warning and "assumed all 320 elements nonzero" in warning
    # the parameters are LLaVA's modules at toy size: every weight found, the mask costs nothing to the count
    torch_params = (12 * 16 + 16) + 2 * (2 * 16 + 16 * 32 + 32 + 32 * 16 + 16) + (16 * 32 + 32) + (32 * 32 + 32) \
        + 64 * 32 + 2 * (2 * 32 + 32 * 64 + 64 + 64 * 32 + 32) + (32 * 64 + 64)
    assert totals(g)["param_count"] == torch_params


def test_routed_nonzero_is_moe_routing_and_said_so(tmp_path):
    from opsched.model.onnx_import import import_warnings

    path = save(make_moe_model("legacy", experts=4, top_k=2), tmp_path / "m.onnx")
    g = import_onnx(path, dims={"batch": 2, "seq": 12}, capacity_factor=1.25)
    assert g.graph["nonzero_masks"] == {} and len(g.graph["moe_routing"]) == 8
    (routing,) = import_warnings(g)
    assert routing.startswith("MoE routing: 8 data-dependent expert selections") and "1.25" in routing


def test_symbolic_dims_defaults_override_and_errors(tmp_path):
    path = save(make_moe_model("legacy", default_dims="batch=1,seq=8"), tmp_path / "m.onnx")
    g = import_onnx(path)
    assert g.graph["dims"] == {"batch": 1, "seq": 8}
    g2 = import_onnx(path, dims={"seq": 32})
    assert g2.graph["dims"] == {"batch": 1, "seq": 32}
    # attention is quadratic in seq, the rest linear: FLOPs grow more than 4x
    assert totals(g2)["flops"] > 4 * totals(g)["flops"]
    bare = save(make_moe_model("legacy"), tmp_path / "bare.onnx")
    with pytest.raises(OpschedError, match=r"'seq'.*--dim seq=VALUE"):
        import_onnx(bare, dims={"batch": 1})
    with pytest.raises(OpschedError, match="--dim batch=VALUE --dim seq=VALUE"):
        import_onnx(bare)
    with pytest.raises(OpschedError, match="positive integer"):
        parse_dims("batch=0")


def test_exporter_dim_expressions_are_evaluated(tmp_path):
    x = helper.make_tensor_value_info("x", F, ["s0", 4])
    nodes = [helper.make_node("Concat", ["x", "x"], ["c"], name="cat", axis=0),
             helper.make_node("Relu", ["c"], ["y"], name="op")]
    graph = helper.make_graph(nodes, "e", [x], [helper.make_tensor_value_info("y", F, ["2*s0", 4])],
                              value_info=[helper.make_tensor_value_info("c", F, ["2*s0", 4])])
    g = import_onnx(save(helper.make_model(graph), tmp_path / "e.onnx"), dims={"s0": 3})
    assert g.nodes["op"]["op"].flops == 2 * 3 * 4


def test_data_inputs_metadata_decides_weights(tmp_path):
    # With metadata, every non-data input is a weight, even one the heuristic would call data.
    x = helper.make_tensor_value_info("x", F, [4, 8])
    w = helper.make_tensor_value_info("w", F, [4, 8])  # read as an Add operand of the same rank
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"], name="op")], "a", [x, w],
                              [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph)
    assert totals(import_onnx(save(model, tmp_path / "a.onnx")))["param_count"] == 0
    helper.set_model_props(model, {"opsched.data_inputs": "x"})
    g = import_onnx(save(model, tmp_path / "b.onnx"))
    assert totals(g)["param_count"] == 32
    assert g.graph["data_inputs"] == ["x"]


def test_weights_as_initializers_or_inputs_count_the_same(tmp_path):
    # The dynamo builder's weights are external initializers whose data file does not exist.
    d = make_moe_model("dynamo", routing="dense")
    assert all(t.data_location == TensorProto.EXTERNAL for t in d.graph.initializer if t.data_type == F
               and len(t.dims) > 1)
    assert not (tmp_path / "weights.data").exists()
    gd = import_onnx(save(d, tmp_path / "d.onnx"), dims={"batch": 1, "seq": 4})
    assert totals(gd)["param_count"] == moe_param_count()


def test_scope_parsing():
    n = helper.make_node("MatMul", ["a", "b"], ["c"], name="/model/layers.3/mlp/experts.1/w1/MatMul")
    assert node_scope(n) == ("model", "layers.3", "mlp", "experts.1", "w1")
    for value in ("['', 'model', 'model.layers.3', 'model.layers.3.mlp', 'model.layers.3.mlp.experts.1', "
                  "'model.layers.3.mlp.experts.1.w1', 'linear']",
                  "['', 'model', 'layers.3', 'mlp', 'experts.1', 'w1', 'linear']"):
        m = helper.make_node("MatMul", ["a", "b"], ["c"], name="node_linear")
        entry = m.metadata_props.add()
        entry.key, entry.value = "pkg.torch.onnx.name_scopes", value
        assert node_scope(m) == ("model", "layers.3", "mlp", "experts.1", "w1")
    assert node_scope(helper.make_node("Identity", ["a"], ["b"], name="Identity_98")) == ()


PAIRS = ["moe_capacity", "deepseek_lm_2L_sh1_r4", "clip"]


@pytest.mark.parametrize("stem", PAIRS)
def test_real_export_pairs_agree(stem):
    dyn = import_onnx(real_export(f"{stem}.dynamo.onnx"))
    leg = import_onnx(real_export(f"{stem}.legacy.onnx"))
    assert (dyn.graph["exporter"], leg.graph["exporter"]) == ("dynamo", "legacy")
    td, tl = totals(dyn), totals(leg)
    for g in (dyn, leg):
        assert g.graph["warnings"] == []
        assert len(g.graph["data_inputs"]) >= 1
    # Parameters: equal, except that dynamo's optimizer deletes the all-zero out_proj
    # bias of nn.MultiheadAttention (it saw the values when exporting): 64 per attention layer.
    attention_layers = {"moe_capacity": 0, "deepseek_lm_2L_sh1_r4": 2, "clip": 4}[stem]
    assert tl["param_count"] - td["param_count"] == 64 * attention_layers
    # FLOPs: the same up to those bias adds, legacy's scalar shape arithmetic (Sqrt, Mod, Div)
    # and legacy's combine step of moe_capacity (zeros + ScatterElements + Add per expert where
    # dynamo chains ScatterND: 4 Adds of 32x64): within 0.5 %.
    assert td["flops"] == pytest.approx(tl["flops"], rel=5e-3)
    # ...and exactly the same inside the experts.
    def expert_flops(g):
        return sum(o.flops for _, o in g.nodes(data="op") if any(p.startswith("experts.") for p in o.scope))
    assert expert_flops(dyn) == expert_flops(leg)
    if stem != "clip":
        assert expert_flops(dyn) > 0.5 * td["flops"]
    # scopes are understood for both: every MatMul/Gemm with a weight sits in a module
    # (CLIP's image-text similarity MatMul has no weight and lives in the root module)
    for g in (dyn, leg):
        assert all(o.scope for _, o in g.nodes(data="op") if o.op_type in ("MatMul", "Gemm") and o.param_count)


def test_real_exports_all_import():
    for name in ("clip.dynamo.onnx", "clip.legacy.onnx", "llava.legacy.onnx", "llava_mask.legacy.onnx",
                 "moe_capacity.dynamo.onnx",
                 "moe_capacity.legacy.onnx", "deepseek_lm_2L_sh1_r4.dynamo.onnx",
                 "deepseek_lm_2L_sh1_r4.legacy.onnx"):
        g = import_onnx(real_export(name))
        t = totals(g)
        assert t["flops"] > 0 and t["param_count"] > 0
        assert g.number_of_nodes() == len(onnx.load(str(real_export(name)), load_external_data=False).graph.node)


def test_mixtral_parameter_count():
    g = import_onnx(REPO / "models" / "mixtral_8x7b.onnx")
    assert totals(g)["param_count"] == pytest.approx(46.7e9, rel=0.005)


def test_attention_3d_inputs_with_head_counts(tmp_path):
    b, s, hq, hkv, d = 2, 6, 4, 2, 8
    m = _single_op_model("Attention", [("q", [b, s, hq * d], F), ("k", [b, s, hkv * d], F), ("v", [b, s, hkv * d], F)],
                         q_num_heads=hq, kv_num_heads=hkv)
    flops, _ = _flops_of(tmp_path, m)
    scores = b * hq * s * s
    assert flops == 2 * scores * (d + d) + 6 * scores


def test_matmul_with_unknown_shapes_warns(tmp_path):
    x = helper.make_tensor_value_info("x", F, [4, 4])
    nodes = [helper.make_node("Mystery", ["x"], ["m"], name="mystery", domain="com.example"),
             helper.make_node("MatMul", ["m", "x"], ["y"], name="op")]
    graph = helper.make_graph(nodes, "u", [x], [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.example", 1)])
    g = import_onnx(save(model, tmp_path / "u.onnx"))
    assert g.nodes["op"]["op"].flops == 0
    assert any("unknown shapes" in w and "op" in w for w in g.graph["warnings"])
    assert any("Mystery x1" in w for w in g.graph["warnings"])


def test_hugging_face_onehot_expert_loop(tmp_path):
    """The HF Mixtral loop: one_hot(selected).permute(2, 1, 0); where(mask[e]); index_add."""
    T, H, FF, E, K = 10, 8, 16, 4, 2
    I64 = TensorProto.INT64

    def c(name, values, dtype=I64, dims=None):
        arr = np.array(values, dtype=np.int64 if dtype == I64 else np.float32)
        return helper.make_tensor(name, dtype, list(arr.shape) if dims is None else dims, arr.reshape(-1).tolist())

    inits = [c("k", [K]), c("depth", [E], dims=[]), c("onoff", [0, 1]), c("row0", 0, dims=[]),
             c("row1", 1, dims=[]), c("minus1_h", [-1, H]), c("ax1", [1])]
    inputs = [helper.make_tensor_value_info("x", F, [T, H]), helper.make_tensor_value_info("gate", F, [H, E])]
    nodes = [helper.make_node("MatMul", ["x", "gate"], ["logits"], name="/moe/gate/MatMul"),
             helper.make_node("Softmax", ["logits"], ["probs"], name="/moe/Softmax", axis=-1),
             helper.make_node("TopK", ["probs", "k"], ["w", "sel"], name="/moe/TopK", axis=-1),
             helper.make_node("OneHot", ["sel", "depth", "onoff"], ["oh"], name="/moe/OneHot", axis=-1),
             helper.make_node("Transpose", ["oh"], ["mask"], name="/moe/Transpose", perm=[2, 1, 0])]
    acc = "x0"
    nodes.append(helper.make_node("Mul", ["x", "zero"], [acc], name="/moe/Mul"))
    inits.append(c("zero", [0.0], dtype=F))
    for e in range(E):
        p = f"/moe/experts.{e}"
        inits += [c(f"e{e}", e, dims=[])]
        inputs += [helper.make_tensor_value_info(f"w1_{e}", F, [H, FF]),
                   helper.make_tensor_value_info(f"w2_{e}", F, [FF, H])]
        nodes += [
            helper.make_node("Gather", ["mask", f"e{e}"], [f"m{e}"], name=f"/moe/Gather_m{e}", axis=0),
            helper.make_node("NonZero", [f"m{e}"], [f"nz{e}"], name=f"/moe/NonZero_{e}"),
            helper.make_node("Gather", [f"nz{e}", "row1"], [f"tok{e}"], name=f"/moe/Gather_t{e}", axis=0),
            helper.make_node("Gather", ["x", f"tok{e}"], [f"xs{e}"], name=f"/moe/Gather_x{e}", axis=0),
            helper.make_node("Reshape", [f"xs{e}", "minus1_h"], [f"xe{e}"], name=f"/moe/Reshape_{e}"),
            helper.make_node("MatMul", [f"xe{e}", f"w1_{e}"], [f"h{e}"], name=f"{p}/w1/MatMul"),
            helper.make_node("Relu", [f"h{e}"], [f"a{e}"], name=f"{p}/act/Relu"),
            helper.make_node("MatMul", [f"a{e}", f"w2_{e}"], [f"y{e}"], name=f"{p}/w2/MatMul"),
            helper.make_node("Unsqueeze", [f"tok{e}", "ax1"], [f"idx{e}"], name=f"/moe/Unsqueeze_{e}"),
            helper.make_node("ScatterND", [acc, f"idx{e}", f"y{e}"], [f"acc{e}"], name=f"/moe/ScatterND_{e}",
                             reduction="add"),
        ]
        acc = f"acc{e}"
    graph = helper.make_graph(nodes, "hf", inputs, [helper.make_tensor_value_info(acc, F, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    helper.set_model_props(model, {"opsched.data_inputs": "x"})
    g = import_onnx(save(model, tmp_path / "hf.onnx"), capacity_factor=1.0)
    n = math.ceil(T * K / E)  # 5 tokens per expert
    assert set(g.graph["moe_routing"].values()) == {n}
    assert g.nodes["/moe/experts.2/w1/MatMul"]["op"].flops == 2 * n * H * FF
    assert totals(g)["param_count"] == H * E + E * 2 * H * FF
    assert g.graph["warnings"] == []


# Tiny-config Hugging Face Mixtral and Qwen2-MoE (2 layers, hidden 32, 4 experts, top-2) with
# transformers' batched experts: one [experts, ...] weight per projection, read by GatherND of
# the routed expert ids, then a batched MatMul (tests/data/make_hf_moe.py).
BATCHED = {"mixtral_batched_experts.dynamo.onnx": dict(ffn=48, shared=0),
           "qwen2_moe_batched_experts.dynamo.onnx": dict(ffn=24, shared=40)}


def _torch_counts(name):
    meta = {p.key: p.value for p in onnx.load(str(real_export(name)), load_external_data=False).metadata_props}
    return int(meta["opsched.test.torch_params"]), meta


@pytest.mark.parametrize("name", sorted(BATCHED))
def test_batched_experts_count_every_parameter(name):
    g = import_onnx(real_export(name))
    params, _ = _torch_counts(name)
    # The model's own sum(p.numel()) plus the rotary inv_freq buffer (head_dim / 2 = 4
    # floats), which the exporter writes as a float initializer like a weight. Before
    # stacked weights were read as parameters the count was a quarter of this (10,660 of
    # 47,524 for Mixtral).
    assert totals(g)["param_count"] == params + 4
    model = onnx.load(str(real_export(name)), load_external_data=False)
    stacked = sum(math.prod(t.dims) for t in model.graph.initializer if len(t.dims) == 3)
    expert_params = sum(o.param_count for _, o in g.nodes(data="op") if any(p.startswith("experts.") for p in o.scope))
    assert expert_params == stacked
    assert g.graph["warnings"] == []


@pytest.mark.parametrize("cf", [1.0, 1.25, 0.5])
@pytest.mark.parametrize("name", sorted(BATCHED))
def test_batched_experts_flops_follow_the_per_expert_routing_rule(tmp_path, name, cf):
    batch, seq, hidden, experts, top_k, layers = 2, 8, 32, 4, 2, 2
    ffn = BATCHED[name]["ffn"]
    g = import_onnx(real_export(name), capacity_factor=cf)
    # Each expert gets the rows the per-expert style's NonZero pin gives it: the same rule,
    # the same number, for the same tokens, experts, top-k and capacity factor.
    per_expert = make_moe_model("dynamo", experts=experts, top_k=top_k, routing="nonzero")
    pinned = import_onnx(save(per_expert, tmp_path / "p.onnx"), dims={"batch": batch, "seq": seq}, capacity_factor=cf)
    rows = set(pinned.graph["moe_routing"].values())
    assert rows == {math.ceil(cf * batch * seq * top_k / experts)}
    n = rows.pop()
    assert {f["rows_per_expert"] for f in g.graph["stacked_experts"].values()} == {n}
    # SwiGLU expert: gate_up (H x 2F) and down (F x H) matmuls on n rows each, per expert,
    # per layer: exactly (the matmuls of one expert are whole multiples of a row).
    by_expert: dict = {}
    for _, o in g.nodes(data="op"):
        e = [p for p in o.scope if p.startswith("experts.")]
        if e and o.op_type == "MatMul":
            key = (o.scope[:o.scope.index(e[0])], e[0])
            by_expert[key] = by_expert.get(key, 0.0) + o.flops
    assert len(by_expert) == layers * experts
    assert set(by_expert.values()) == {n * (2 * hidden * 2 * ffn + 2 * ffn * hidden)}


@pytest.mark.parametrize("name", sorted(BATCHED))
def test_splitting_batched_experts_keeps_the_totals(name, monkeypatch):
    # At capacity factor 1 with the experts dividing the rows, the split only redistributes FLOPs and
    # parameters: those totals equal the unsplit batched ops'. The bytes lose exactly the gathered copies
    # of the expert weights (GatherND of a stacked weight: one weight matrix per routed row), written by
    # the gather and read by its matmul in the unsplit graph; an expert matmul reads its weight in place.
    g = import_onnx(real_export(name))
    monkeypatch.setattr("opsched.model.onnx_import.split_families", lambda *args: None)
    whole = import_onnx(real_export(name))
    assert g.number_of_nodes() > whole.number_of_nodes()
    gathered = sum(o.output_bytes for _, o in whole.nodes(data="op")
                   if o.op_type == "GatherND" and o.param_count and "experts" in o.scope)
    assert gathered > totals(whole)["output_bytes"] / 2  # most of the unsplit graph's bytes, at this tiny size
    for field in ("flops", "param_bytes"):
        assert totals(g)[field] == pytest.approx(totals(whole)[field], rel=1e-12)
    assert totals(g)["output_bytes"] == pytest.approx(totals(whole)["output_bytes"] - gathered, rel=1e-12)
    assert totals(g)["io_bytes"] == pytest.approx(totals(whole)["io_bytes"] - 2 * gathered, rel=1e-12)
    assert totals(g)["param_count"] == totals(whole)["param_count"]


def test_stacked_weights_without_a_router_stay_whole(tmp_path):
    # A rank-3 weight read by Gather is a plain table when no TopK routes over its leading axis.
    w = onnx.TensorProto(name="w", data_type=F, dims=[4, 8, 8])
    w.data_location = onnx.TensorProto.EXTERNAL
    entry = w.external_data.add()
    entry.key, entry.value = "location", "absent.data"
    x = helper.make_tensor_value_info("i", TensorProto.INT64, [6])
    nodes = [helper.make_node("Gather", ["w", "i"], ["g"], name="gather"),
             helper.make_node("MatMul", ["g", "g"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "t", [x], [helper.make_tensor_value_info("y", F, None)], initializer=[w])
    g = import_onnx(save(helper.make_model(graph), tmp_path / "t.onnx"))
    assert g.graph["stacked_experts"] == {}
    assert sorted(g.nodes) == ["gather", "mm"]
    assert totals(g)["param_count"] == 4 * 8 * 8


def test_matmul_batched_over_the_expert_axis_splits_per_expert(tmp_path):
    # Capacity-style dispatch x[E, C, H] @ w1[E, H, F] -> act -> @ w2[E, F, H], with a
    # router TopK over E = 4 experts: 4 experts, each with its slice and 1/E of the work.
    e, c, h, f, t = 4, 6, 8, 16, 12
    inits = []
    for name, shape in (("router", (h, e)), ("w1", (e, h, f)), ("w2", (e, f, h))):
        w = onnx.TensorProto(name=name, data_type=F, dims=list(shape))
        w.data_location = onnx.TensorProto.EXTERNAL
        entry = w.external_data.add()
        entry.key, entry.value = "location", "absent.data"
        inits.append(w)
    inits.append(onnx.numpy_helper.from_array(np.array([2], dtype=np.int64), "k"))
    inits.append(onnx.numpy_helper.from_array(np.array([e, c, h], dtype=np.int64), "disp"))
    nodes = [helper.make_node("MatMul", ["x", "router"], ["logits"], name="gate"),
             helper.make_node("TopK", ["logits", "k"], ["tv", "ti"], name="topk", axis=-1),
             helper.make_node("Reshape", ["x", "disp"], ["xe"], name="dispatch"),
             helper.make_node("MatMul", ["xe", "w1"], ["a"], name="up"),
             helper.make_node("Relu", ["a"], ["r"], name="act"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="down")]
    graph = helper.make_graph(nodes, "cap", [helper.make_tensor_value_info("x", F, [t * 2, h])],
                              [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("tv", F, None)],
                              initializer=inits)
    g = import_onnx(save(helper.make_model(graph), tmp_path / "cap.onnx"))
    assert list(g.graph["stacked_experts"].values()) == [{"experts": e, "rows": None, "rows_per_expert": None}]
    for name, flops, params in (("up", 2 * c * h * f, h * f), ("act", c * f, 0), ("down", 2 * c * f * h, f * h)):
        copies = [g.nodes[f"{name}/experts.{i}"]["op"] for i in range(e)]
        assert [o.scope for o in copies] == [(f"experts.{i}",) for i in range(e)]
        assert {o.flops for o in copies} == {flops} and {o.param_count for o in copies} == {params}
    assert totals(g)["param_count"] == h * e + 2 * e * h * f


def test_row_parallel_layers_are_marked_for_tensor_parallel_all_reduces():
    """Megatron's all-reduce points: attention's output projection, the MLP's down projection, the embedding.

    CLIP's linear layers have biases: a q/k/v or fc1 projection feeds a bias Add and then no residual,
    so it is not marked; out_proj and fc2 reach the residual through their bias Add.
    """
    from collections import Counter

    g = import_onnx(REPO / "models" / "clip_vit_l14.onnx")
    marked = Counter(op.name.split("/")[-2] for op in ops(g) if op.tp_comm_bytes > 0)
    assert marked == {"out_proj": 36, "fc2": 36, "token_embedding": 1}  # 24 vision + 12 text layers
    assert all(op.tp_comm_bytes == op.output_bytes for op in ops(g) if op.tp_comm_bytes > 0)


@pytest.mark.parametrize("name", ["deepseek_lm_2L_sh1_r4.dynamo.onnx", "deepseek_lm_2L_sh1_r4.legacy.onnx",
                                  "mixtral_batched_experts.dynamo.onnx"])
def test_unfused_attention_is_marked_and_routers_are_not(name):
    """QK^T, its scaling / mask / softmax, and attention over V are attention; a router's Softmax is not."""
    records = list(ops(import_onnx(real_export(name))))
    softmax = [op for op in records if op.op_type == "Softmax"]
    marked = [op for op in softmax if op.attention_flops > 0]
    assert len(marked) == 2  # one attention per layer of the two
    assert all("attn" in "/".join(op.scope) for op in marked)
    routers = [op for op in softmax if op not in marked]
    assert len(routers) == 2  # each layer's MoE router
    assert all(op.attention_flops == 0 and op.attention_scores_bytes == 0 for op in routers)
    core = [op for op in records if op.attention_flops > 0]
    assert sum(op.op_type == "MatMul" and op.param_count == 0 for op in core) == 4  # QK^T and AV, twice
    # the scores are what the core writes before attention over V; its output is not one of them
    assert 0 < sum(op.attention_scores_bytes for op in core) < sum(op.output_bytes for op in core)
    assert sum(op.attention_kv_bytes for op in core) > 0
    assert all(op.attention_flops == op.flops for op in core)


def test_inference_after_pins_propagates_data_when_shapes_would_be_left_unknown():
    """Shape inference after the NonZero pins skips data propagation (seconds per thousand routed tokens) only when
    every shape is known without it: a Reshape to a computed shape needs it, and gets it."""
    from opsched.model.onnx_import import _infer, _infer_after_pins, _shape_table

    g = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["z", "s"], ["r"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [6])],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert _shape_table(_infer(model, data_prop=False))["r"][0] != (2, 3)  # the case this test is about
    assert _infer_after_pins(model)[1]["r"] == ((2, 3), TensorProto.FLOAT)


@pytest.mark.parametrize("model, layers, heads, head_dim", [("gpt_1_7b", 24, 24, 96), ("mpt_7b", 32, 32, 128)])
def test_attention_ops_record_their_scores_and_padded_multiplies(model, layers, heads, head_dim):
    """What an unfused run of each fused Attention op writes (batch x heads x s x s scores) and computes (Q·Kᵀ and
    scores·V as batched GEMMs, a head dimension of 96 padded to the 128-wide tile: 4/3 of the FLOPs)."""
    batch, seq = 2, 256
    g = import_onnx(str(REPO / "models" / f"{model}.onnx"), dims={"batch": batch, "seq": seq})
    attention = [op for op in ops(g) if op.op_type == "Attention"]
    assert len(attention) == layers
    scores = batch * heads * seq * seq
    gemm = 2 * scores * 2 * head_dim  # useful FLOPs of the two multiplies
    for op in attention:
        assert op.attention_scores == scores
        assert op.attention_flops == gemm + 6 * scores
        assert op.attention_gemm_padded_flops == pytest.approx(gemm * math.ceil(head_dim / 128) * 128 / head_dim)
    assert all(op.attention_scores == 0 for op in ops(g) if op.op_type != "Attention")
    assert totals(g)["attention_scores"] == layers * scores
