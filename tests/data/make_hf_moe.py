"""Write the tiny Hugging Face MoE exports in tests/data/onnx (batched experts).

Run from the repository root with transformers, torch and onnxscript installed:

    python tests/data/make_hf_moe.py

Each model is a tiny-config transformers model (2 layers, hidden 32, 4 experts,
top-2) whose experts are stacked ``[experts, ...]`` weights, run with
transformers' ``batched_mm`` experts implementation (``weight[expert_ids]``,
exported as ``GatherND``, then a batched ``MatMul``) and exported with
``torch.onnx.export(..., dynamo=True)``. The weights go to an external data
file that is not kept (import reads shapes only). The metadata key
``opsched.test.torch_params`` records the model's own ``sum(p.numel())`` and
``opsched.test.torch_float_buffers`` the elements of its float buffers (the
rotary ``inv_freq``), which the exporter also writes as initializers.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import onnx
import torch

OUT = Path(__file__).resolve().parent / "onnx"


def tiny(name: str):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, use_cache=False)
    if name == "mixtral":
        cfg = MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common)
        cls = MixtralForCausalLM
    else:
        cfg = Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                             num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, **common)
        cls = Qwen2MoeForCausalLM
    cfg._experts_implementation = "batched_mm"
    return cls(cfg).eval()


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def export(name: str) -> Path:
    torch.manual_seed(0)
    model = tiny(name)
    ids = torch.randint(0, 64, (2, 8))
    dims = {"input_ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}}
    program = torch.onnx.export(Logits(model), (ids,), dynamo=True, dynamic_shapes=dims, input_names=["input_ids"],
                                output_names=["logits"], optimize=True)
    out = OUT / f"{name}_batched_experts.dynamo.onnx"
    with tempfile.TemporaryDirectory() as tmp:
        program.save(str(Path(tmp) / out.name), external_data=True)
        proto = onnx.load(str(Path(tmp) / out.name), load_external_data=False)
    _strip(proto)
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    onnx.helper.set_model_props(proto, {"opsched.test.torch_params": str(params),
                                        "opsched.test.torch_float_buffers": str(buffers),
                                        "opsched.default_dims": "batch=2,seq=8"})
    out.write_bytes(proto.SerializeToString())
    return out


def _strip(proto) -> None:
    """Leave the float weights' data out (an external file that is not kept) and keep only the name scopes."""
    for t in proto.graph.initializer:
        if t.data_type != onnx.TensorProto.FLOAT or not len(t.dims) or t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        t.ClearField("raw_data")
        t.ClearField("float_data")
        t.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", "weights.data"), ("offset", "0"), ("length", str(4 * math.prod(t.dims)))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
    for n in proto.graph.node:
        keep = [(p.key, p.value) for p in n.metadata_props if p.key == "pkg.torch.onnx.name_scopes"]
        del n.metadata_props[:]
        for key, value in keep:
            entry = n.metadata_props.add()
            entry.key, entry.value = key, value


if __name__ == "__main__":
    for which in sys.argv[1:] or ["mixtral", "qwen2_moe"]:
        print(export(which))
