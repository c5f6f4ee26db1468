"""Shared test helpers: where the real torch exports live, and a small MoE model builder.

``make_moe_model`` writes the same PyTorch-like MoE language model in the two
shapes torch exporters produce, with ``onnx.helper`` (torch is not needed):

* ``style="dynamo"``: nodes carry ``pkg.torch.onnx.name_scopes`` metadata
  (full dotted module paths, like torch 2.13), weights are initializers whose
  data lives in an external file that is *not* written;
* ``style="legacy"``: node names are ``/layers.0/mlp/experts.1/w1/MatMul``,
  weights are typed graph inputs, constants are ``Constant`` nodes.

``routing="nonzero"`` exports each expert as a loop body over the tokens routed
to it (Equal -> NonZero -> Gather -> expert -> ScatterND), the Hugging Face
pattern with data-dependent token counts; ``routing="dense"`` runs every expert
on every token and weights the result (static shapes).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

ONNX_DIR = Path(__file__).resolve().parent / "data" / "onnx"  # copies of ../shared/data/onnx
REPO = Path(__file__).resolve().parents[1]
OPSET = 23

# A 4-device cluster of round numbers with one device per node, so transfers
# between groups are slow enough for placement to matter.
SLOW_LINK_CLUSTER = {
    "devices": 4,
    "devices_per_node": 1,
    "peak_flops": {"bf16": 100e12},
    "efficiency": 0.5,
    "memory_bytes": 80e9,
    "memory_bandwidth": 1e12,
    "intra_node_bandwidth": 100e9,
    "intra_node_latency": 1e-6,
    "inter_node_bandwidth": 10e9,
    "inter_node_latency": 10e-6,
}

def hand_1f1b(stages: int, microbatches: int) -> dict:
    """1F1B written out by hand (fused B), stage k on device k: an order the
    schedule-core tests build without the baselines package."""
    from opsched.schedule import Job

    order = {}
    for s in range(stages):
        warm = min(stages - s - 1, microbatches)
        acts = [Job(s, m, "F") for m in range(warm)]
        f, b = warm, 0
        while b < microbatches:
            if f < microbatches:
                acts.append(Job(s, f, "F"))
                f += 1
            acts.append(Job(s, b, "B"))
            b += 1
        order[s] = acts
    return order


def real_export(name: str) -> Path:
    """Path of one of the real torch exports shipped in tests/data/onnx."""
    path = ONNX_DIR / name
    assert path.exists(), f"{path} is missing: the real exports are part of the test suite"
    return path


class _Builder:
    """Accumulates nodes, weights and constants in one exporter style."""

    def __init__(self, style: str):
        self.style = style
        self.nodes: list = []
        self.inits: list = []
        self.weight_inputs: list = []
        self.count = 0

    def weight(self, name: str, shape) -> str:
        if self.style == "legacy":
            self.weight_inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)))
        else:
            t = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", "weights.data"), ("offset", "0"),
                               ("length", str(4 * int(np.prod(shape))))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            self.inits.append(t)
        return name

    def const(self, scope, values, dtype=np.int64) -> str:
        arr = np.array(values, dtype=dtype)
        self.count += 1
        if self.style == "legacy":
            out = f"/{'/'.join(scope)}/Constant_{self.count}_output_0" if scope else f"/Constant_{self.count}_output_0"
            self.node("Constant", [], scope, out=out, value=onnx.numpy_helper.from_array(arr))
            return out
        name = f"val_{self.count}"
        self.inits.append(onnx.numpy_helper.from_array(arr, name))
        return name

    def node(self, op, inputs, scope, out=None, n_out=1, **attrs):
        self.count += 1
        if self.style == "legacy":
            base = "/" + "/".join(list(scope) + [f"{op}_{self.count}"])
            outs = [out] if out else [f"{base}_output_{i}" for i in range(n_out)]
            node = helper.make_node(op, inputs, outs, name=base, **attrs)
        else:
            outs = [out] if out else [f"{op.lower()}_{self.count}_{i}" for i in range(n_out)]
            node = helper.make_node(op, inputs, outs, name=f"node_{op}_{self.count}", **attrs)
            full, paths = "", [""]
            for part in scope:
                full = f"{full}.{part}" if full else part
                paths.append(full)
            paths.append(op.lower())
            entry = node.metadata_props.add()
            entry.key, entry.value = "pkg.torch.onnx.name_scopes", repr(paths)
        self.nodes.append(node)
        return outs[0] if n_out == 1 else outs


def make_moe_model(style: str = "legacy", layers: int = 2, experts: int = 4, top_k: int = 2, hidden: int = 16,
                   ffn: int = 32, vocab: int = 64, routing: str = "nonzero", dims=("batch", "seq"),
                   default_dims: str | None = None, data_inputs_meta: bool = False, shared_expert: bool = False,
                   name: str = "tiny_moe") -> onnx.ModelProto:
    """A small MoE language model (see the module docstring); ``dims`` are the input's two dims."""
    b = _Builder(style)
    ids = "input_ids"
    x = b.node("Gather", [b.weight("embed.weight", (vocab, hidden)), ids], ("embed",))
    for layer in range(layers):
        L = f"layers.{layer}"
        h = b.node("LayerNormalization", [x, b.weight(f"{L}.ln1.weight", (hidden,)),
                                          b.weight(f"{L}.ln1.bias", (hidden,))], (L, "ln1"), axis=-1)
        q = b.node("MatMul", [h, b.weight(f"{L}.attn.q", (hidden, hidden))], (L, "attn", "q_proj"))
        k = b.node("MatMul", [h, b.weight(f"{L}.attn.k", (hidden, hidden))], (L, "attn", "k_proj"))
        v = b.node("MatMul", [h, b.weight(f"{L}.attn.v", (hidden, hidden))], (L, "attn", "v_proj"))
        kt = b.node("Transpose", [k], (L, "attn"), perm=[0, 2, 1])
        s = b.node("MatMul", [q, kt], (L, "attn"))
        p = b.node("Softmax", [s], (L, "attn"), axis=-1)
        a = b.node("MatMul", [p, v], (L, "attn"))
        o = b.node("MatMul", [a, b.weight(f"{L}.attn.o", (hidden, hidden))], (L, "attn", "o_proj"))
        x = b.node("Add", [x, o], (L,))
        h = b.node("LayerNormalization", [x, b.weight(f"{L}.ln2.weight", (hidden,)),
                                          b.weight(f"{L}.ln2.bias", (hidden,))], (L, "ln2"), axis=-1)
        M = (L, "mlp")
        flat = b.node("Reshape", [h, b.const(M, [-1, hidden])], M)
        logits = b.node("MatMul", [flat, b.weight(f"{L}.mlp.gate.weight", (hidden, experts))], M + ("gate",))
        probs = b.node("Softmax", [logits], M, axis=-1)
        topv, topi = b.node("TopK", [probs, b.const(M, [top_k])], M, n_out=2, axis=-1)
        acc = None
        zero = b.node("Mul", [flat, b.const(M, [0.0], np.float32)], M)
        for e in range(experts):
            E = M + (f"experts.{e}",)
            if routing == "nonzero":
                mask = b.node("Equal", [topi, b.const(M, e)], M)
                nz = b.node("NonZero", [mask], M)
                tok = b.node("Gather", [nz, b.const(M, 0)], M, axis=0)
                xe = b.node("Gather", [flat, tok], M, axis=0)
            else:
                xe = flat
            g1 = b.node("MatMul", [xe, b.weight(f"{L}.mlp.experts.{e}.w1", (hidden, ffn))], E + ("w1",))
            sg = b.node("Sigmoid", [g1], E)
            act = b.node("Mul", [g1, sg], E)
            y = b.node("MatMul", [act, b.weight(f"{L}.mlp.experts.{e}.w2", (ffn, hidden))], E + ("w2",))
            if routing == "nonzero":
                idx = b.node("Unsqueeze", [tok, b.const(M, [1])], M)
                acc = b.node("ScatterND", [acc or zero, idx, y], M)
            else:
                w = b.node("Slice", [probs, b.const(M, [e]), b.const(M, [e + 1]), b.const(M, [1])], M)
                yw = b.node("Mul", [y, w], M)
                acc = b.node("Add", [acc or zero, yw], M)
        if shared_expert:
            S = M + ("shared_experts.0",)
            g1 = b.node("MatMul", [flat, b.weight(f"{L}.mlp.shared.w1", (hidden, ffn))], S + ("w1",))
            y = b.node("MatMul", [g1, b.weight(f"{L}.mlp.shared.w2", (ffn, hidden))], S + ("w2",))
            acc = b.node("Add", [acc, y], M)
        shape = b.node("Shape", [h], M)
        moe = b.node("Reshape", [acc, shape], M)
        x = b.node("Add", [x, moe], (L,))
    h = b.node("LayerNormalization", [x, b.weight("norm.weight", (hidden,)), b.weight("norm.bias", (hidden,))],
               ("norm",), axis=-1)
    out = b.node("MatMul", [h, b.weight("lm_head.weight", (hidden, vocab))], ("lm_head",))
    graph = helper.make_graph(
        b.nodes, name,
        [helper.make_tensor_value_info(ids, TensorProto.INT64, list(dims))] + b.weight_inputs,
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        initializer=b.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="pytorch" if style in ("dynamo", "legacy") else "opsched-tests")
    meta = {}
    if default_dims:
        meta["opsched.default_dims"] = default_dims
    if data_inputs_meta:
        meta["opsched.data_inputs"] = ids
    onnx.helper.set_model_props(model, meta)
    return model


def moe_param_count(layers=2, experts=4, hidden=16, ffn=32, vocab=64, shared_expert=False) -> int:
    """The parameter count of :func:`make_moe_model`, by hand."""
    per_layer = 4 * hidden + 4 * hidden * hidden + hidden * experts + experts * 2 * hidden * ffn
    if shared_expert:
        per_layer += 2 * hidden * ffn
    return vocab * hidden + layers * per_layer + 2 * hidden + hidden * vocab


def save(model: onnx.ModelProto, path) -> Path:
    """Write a model without checking it (tests write broken models on purpose)."""
    path = Path(path)
    path.write_bytes(model.SerializeToString())
    return path


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (Linux /proc): not gone, and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def block_of_ops(blockgraph) -> dict[str, int]:
    """OpGraph node name -> block id."""
    return {v: b for b, data in blockgraph.nodes(data=True) for v in data["block"].ops}


def job_order(order) -> dict[int, list]:
    """The order with pairs split into their two jobs."""
    from opsched.schedule import jobs_of

    return {d: [j for a in actions for j in jobs_of(a)] for d, actions in order.items()}
