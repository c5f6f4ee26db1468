"""A model exported with a static batch is imported like one with a symbolic batch (issue 45, item 2).

The oracle: the same model exported with a dynamic batch axis, imported at
the same batch. A static copy is made the way a static export looks (every
symbolic dim fixed, the metadata's default dims gone), imported at other
batches, and its costs must match the dynamic model's at those batches.
"""

from __future__ import annotations

import json

import onnx
import pytest
from helpers import make_moe_model, real_export

from opsched.cli import main
from opsched.errors import OpschedError
from opsched.model.graph import totals
from opsched.model.onnx_import import import_onnx

#: what must grow with the batch exactly as in the dynamic export (parameters must not grow at all)
COSTS = ("flops", "matmul_flops", "attention_flops", "saved_bytes", "output_bytes", "io_bytes", "tp_comm_bytes",
         "param_count", "param_bytes")


def _static_copy(model: onnx.ModelProto, dims: dict[str, int]) -> onnx.ModelProto:
    """``model`` with every symbolic dim fixed at ``dims`` and no default dims: a static export of it."""
    static = onnx.ModelProto()
    static.CopyFrom(model)
    del static.metadata_props[:]
    g = static.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param"):
                if d.dim_param in dims:
                    d.dim_value = dims[d.dim_param]
                else:
                    d.Clear()  # an expression of them: shape inference finds it again
    return static


def _costs(path, **dims) -> dict[str, float]:
    t = totals(import_onnx(path, dims=dims or None, strict_dims=True))
    return {k: t[k] for k in COSTS}


@pytest.mark.parametrize("style", ["legacy", "dynamo"])
@pytest.mark.parametrize("batch", [1, 3, 4, 8])
def test_static_batch_costs_as_the_dynamic_export_does(tmp_path, style, batch):
    dynamic = make_moe_model(style, layers=2, experts=4, top_k=2, routing="capacity")
    static = _static_copy(dynamic, {"batch": 2, "seq": 8})
    onnx.save(dynamic, tmp_path / "dynamic.onnx")
    onnx.save(static, tmp_path / "static.onnx")
    # its weights are graph inputs too: the batch is the data input's leading axis alone
    assert import_onnx(tmp_path / "static.onnx").graph["static_batch"] == 2
    assert import_onnx(tmp_path / "dynamic.onnx", dims={"batch": 2, "seq": 8}).graph["static_batch"] is None
    want = _costs(tmp_path / "dynamic.onnx", batch=batch, seq=8)
    got = _costs(tmp_path / "static.onnx", batch=batch)
    for key in COSTS:
        # shape tensors (Shape's int64 outputs) scale in the static copy and not in the dynamic one: a few bytes
        assert got[key] == pytest.approx(want[key], rel=1e-3), key
    assert got["param_count"] == want["param_count"]


def test_static_batch_defaults_to_the_exported_one_and_says_when_rescaled():
    path = real_export("deepseek_lm_2L_sh1_r4.dynamo.onnx")
    as_exported = import_onnx(path, strict_dims=True)
    assert as_exported.graph["dims"]["batch"] == 2 and as_exported.graph["static_batch"] == 2
    assert not any("static batch" in w for w in as_exported.graph["warnings"])
    one = import_onnx(path, dims={"batch": 1}, strict_dims=True)
    assert any("static batch of 2" in w and "batch 1" in w for w in one.graph["warnings"])
    assert totals(one)["flops"] == pytest.approx(totals(as_exported)["flops"] / 2)
    assert totals(one)["param_count"] == totals(as_exported)["param_count"]


def test_inputs_that_disagree_have_no_batch_found(tmp_path):
    """Leading sizes that differ (or a rank-1 input) name no batch axis: --dim batch stays an unknown name."""
    model = make_moe_model("legacy", routing="capacity")
    static = _static_copy(model, {"batch": 2, "seq": 8})
    extra = onnx.helper.make_tensor_value_info("other", onnx.TensorProto.INT64, [3, 8])
    static.graph.input.append(extra)
    onnx.save(static, tmp_path / "m.onnx")
    assert import_onnx(tmp_path / "m.onnx").graph["static_batch"] is None
    with pytest.raises(OpschedError, match="batch"):
        import_onnx(tmp_path / "m.onnx", dims={"batch": 4}, strict_dims=True)


@pytest.mark.parametrize("runtime", ["torchtitan", "megatron"])
def test_static_export_plans_with_a_global_batch_for_every_runtime(tmp_path, capsys, runtime):
    """The user's case: a real static export, --global-batch and a runtime that needs Megatron-style layouts."""
    out = tmp_path / "out"
    code = main(["plan", str(real_export("deepseek_lm_2L_sh1_r4.dynamo.onnx")), "--devices", "4", "--global-batch", "16",
                 "--runtime", runtime, "--time-limit", "20", "-o", str(out), "--quiet"])
    assert code == 0, capsys.readouterr().err
    doc = json.loads((out / "plan.json").read_text())
    assert runtime in doc["runtimes"]
    assert doc["microbatches"] * doc["microbatch_size"] == 16
