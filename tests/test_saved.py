"""Stored activations: what the import says each operator keeps for the backward (opsched.model.saved).

Checked against the world twice: PyTorch's autograd, which reports every tensor it saves (the tensors a
training step holds per microbatch), and Korthikanti et al. 2022's per-layer count for a GPT layer.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from opsched.model.coarsen import coarsen
from opsched.cost.blocks import Mode, stored_activation_bytes
from opsched.model.onnx_import import import_onnx
from opsched.model.saved import saved_tensors

MODELS = Path(__file__).resolve().parents[1] / "models"


def _torch_models():
    """Two small decoders written as PyTorch runs them: GPT-style (LayerNorm, fused QKV with biases, GeLU) and
    Llama-style (RMSNorm, separate projections, SwiGLU). Attention is written out in both, as the exporters write
    it, so the export and the eager run compute the same operators."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    def attention(q, k, v):
        d = q.shape[-1]
        t = q.shape[-2]
        mask = torch.full((t, t), float("-inf")).triu(1)
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d) + mask, dim=-1) @ v

    class RMSNorm(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class GPTLayer(nn.Module):
        def __init__(self, h, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):
            b, t, h = x.shape
            q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(self.ln1(x)).split(h, dim=-1))
            x = x + self.proj(attention(q, k, v).transpose(1, 2).reshape(b, t, h))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class LlamaLayer(nn.Module):
        def __init__(self, h, heads):
            super().__init__()
            self.heads = heads
            self.n1, self.n2 = RMSNorm(h), RMSNorm(h)
            self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
            self.gate, self.up, self.down = nn.Linear(h, 3 * h, False), nn.Linear(h, 3 * h, False), nn.Linear(3 * h, h, False)

        def forward(self, x):
            b, t, h = x.shape
            y = self.n1(x)
            q, k, v = (f(y).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
            x = x + self.o(attention(q, k, v).transpose(1, 2).reshape(b, t, h))
            y = self.n2(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class Decoder(nn.Module):
        def __init__(self, layer, h=64, heads=4, layers=2, vocab=100):
            super().__init__()
            self.embed = nn.Embedding(vocab, h)
            self.layers = nn.ModuleList(layer(h, heads) for _ in range(layers))
            self.norm = nn.LayerNorm(h)
            self.head = nn.Linear(h, vocab, bias=False)

        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    return {"gpt": lambda: Decoder(GPTLayer), "llama": lambda: Decoder(LlamaLayer)}


def _autograd_saved_bytes(model, ids) -> int:
    """Bytes of the activations autograd saves in one forward, each storage once, parameters left out."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids)
    return sum(kept.values())


@pytest.mark.parametrize("exporter", ["legacy", pytest.param("dynamo", marks=pytest.mark.slow)])  # dynamo: ~10 s
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_saved_bytes_match_autograd(tmp_path, arch, exporter):
    torch = pytest.importorskip("torch")
    if exporter == "dynamo":
        pytest.importorskip("onnxscript", reason="torch's dynamo exporter needs onnxscript")
    torch.manual_seed(0)
    model = _torch_models()[arch]()
    ids = torch.randint(0, 100, (2, 32))
    measured = _autograd_saved_bytes(model, ids)
    path = tmp_path / f"{arch}.onnx"
    torch.onnx.export(model, (ids,), str(path), input_names=["ids"], dynamo=exporter == "dynamo")
    og = import_onnx(str(path))
    predicted = sum(og.nodes[n]["op"].saved_bytes for n in og.nodes)
    every_output = sum(og.nodes[n]["op"].output_bytes for n in og.nodes)
    # the import leaves out the norms' per-row statistics (2 floats per token), a fraction of a percent here
    assert predicted == pytest.approx(measured, rel=0.02)
    assert every_output > 1.5 * measured  # what the import counted before: every tensor written


@pytest.mark.parametrize("name, hidden", [("mcore_gpt_1_7b", 2048), ("mcore_gpt_7_1b", 4096)])
def test_gpt_layer_keeps_korthikanti_count(name, hidden):
    """Korthikanti et al. 2022, Table 2: a GPT layer stores 34·sbh bytes, 10·sbh of them outside the tensor-parallel
    regions, two dropout masks of sbh included; these exports have no dropout, so 32·sbh and 8·sbh."""
    seq = 512
    bg = coarsen(import_onnx(str(MODELS / f"{name}.onnx"), dims={"batch": 1, "seq": seq}))
    sbh = seq * hidden
    layers = [bg.nodes[n]["block"] for n in bg.nodes if bg.nodes[n]["block"].name.endswith("layers.3")]
    assert len(layers) == 1
    layer = layers[0]
    assert layer.saved_bytes == pytest.approx(32 * sbh, rel=1e-3)
    assert layer.tp_replicated_bytes == pytest.approx(8 * sbh, rel=1e-3)
    for t in (2, 8):
        assert stored_activation_bytes(layer, Mode(tp=t)) == pytest.approx(32 * sbh / t, rel=1e-3)
        assert stored_activation_bytes(layer, Mode(tp=t), sequence_parallel=False) == pytest.approx(
            sbh * (8 + 24 / t), rel=1e-3)


def test_rules_keep_nothing_without_a_gradient():
    """An operator none of whose inputs needs a gradient keeps nothing, whatever its type (masks, positions)."""
    never = (lambda name: False)
    for op_type in ("MatMul", "Softmax", "Gelu", "LayerNormalization", "Attention", "Mul", "Div", "SomeCustomOp"):
        assert saved_tensors(op_type, ["a", "b", "c"], ["y"], never) == ()
    # an operator the rules do not know keeps what it writes (the conservative rule)
    assert saved_tensors("SomeCustomOp", ["a"], ["y", "z"], {"a"}.__contains__) == ("y", "z")
