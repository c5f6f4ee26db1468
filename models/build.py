"""Generate the bundled full-size ONNX graphs of ``models/`` with ``onnx.helper``.

Every model is written as a *shape-only* graph: weights are typed graph inputs
(no initializer data), so a 47 B-parameter model fits in a file of a few
hundred KB and imports without reading any tensor data. Run::

    python models/build.py                 # regenerate every bundled model here
    python models/build.py --out DIR llama_7b switch_moe   # some models, elsewhere
    python models/build.py deepseek_v3     # a model too large to ship (19 MB), on demand

Conventions shared by all models (see ``models/README.md``):

- opset 23 (``Attention`` with ``q_num_heads``/``kv_num_heads`` for GQA,
  ``RMSNormalization``, ``LayerNormalization``, ``Gelu``); activations and
  weights in bfloat16 (float16 for the SC'21 GPTs, which were trained in fp16),
  routers in float32 (``TopK`` has no bfloat16 kernel in opset 23, and routers
  run in float32 in the reference implementations).
- node names follow the legacy PyTorch exporter, ``/model/layers.3/self_attn/q_proj/MatMul``,
  so the module scope of a node is its name without the last part; weight inputs
  are named like the Hugging Face parameters, ``model.layers.3.self_attn.q_proj.weight``
  (Megatron's state dict for the SC'21 GPTs, ``language_model.encoder.layers.3.mlp.dense_h_to_4h.weight``).
- symbolic dims ``batch`` and ``seq`` (Switch adds ``dec_seq``) on the data inputs,
  with defaults in ``metadata_props["opsched.default_dims"]`` (``batch=1,seq=4096``)
  and the names of the data inputs in ``metadata_props["opsched.data_inputs"]``;
  every other graph input is a weight.
- MoE layers are a loop over experts, as in the Hugging Face implementations:
  per expert ``NonZero`` over its routing weights gives the (data-dependent)
  tokens it serves, ``GatherND`` dispatches them, the expert's own MatMul chain
  runs, and one ``ScatterND`` (reduction ``add``) per layer combines all experts
  onto the residual stream. The experts of a layer are therefore parallel
  branches (no path between two of them), and their token count is the only
  data-dependent dim: the importer resolves it by balanced routing,
  ``capacity_factor * batch * seq * top_k / experts``, so ``--dim`` values and
  ``--capacity-factor`` determine expert FLOPs.
- positional encodings without parameters (RoPE, MPT's ALiBi) and T5's relative
  position bias (384 parameters per stack) are left out: they change FLOPs by well under
  0.1 % and are not what a pipeline planner decides about.

Output is deterministic: the same script writes the same bytes.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import tempfile

import onnx
from onnx import TensorProto, helper

OPSET = 23
BF16 = TensorProto.BFLOAT16
F16 = TensorProto.FLOAT16
F32 = TensorProto.FLOAT
I64 = TensorProto.INT64


class GraphBuilder:
    """Accumulate the nodes and typed inputs of one shape-only ONNX graph.

    Scopes are module paths written with ``/`` (``model/layers.0/mlp``); a node
    is named ``/<scope>/<OpType>`` (``_1``, ``_2``... when repeated in a scope),
    as the legacy exporter does; its outputs get short names ``t<node index>[_<i>]``.

    >>> b = GraphBuilder("tiny")
    >>> x = b.data("x", ["batch", 8])
    >>> y = linear(b, "model/proj", x, 8, 4)
    >>> b.param_count
    32
    """

    def __init__(self, name: str, dtype: int = BF16):
        self.name = name
        self.dtype = dtype
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.data_inputs: list[str] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.param_count = 0
        self.moe: set[tuple[int, int]] = set()  # (experts, top_k) of the routed layers
        self._names: dict[str, int] = {}

    def data(self, name: str, shape: list, elem_type: int | None = None) -> str:
        """Declare a data (non-weight) graph input and return its name."""
        elem = self.dtype if elem_type is None else elem_type
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        self.data_inputs.append(name)
        return name

    def weight(self, scope: str, leaf: str, shape: list[int], elem_type: int | None = None) -> str:
        """Declare a weight as a typed graph input named like the PyTorch parameter."""
        name = ".".join([part for part in scope.split("/") if part] + [leaf])
        elem = self.dtype if elem_type is None else elem_type
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        self.param_count += math.prod(shape)
        return name

    def node(self, scope: str, op_type: str, inputs: list[str], n_outputs: int = 1, **attrs):
        """Add one node in ``scope``; return its output name (or list of names if several)."""
        base = f"/{scope}/{op_type}" if scope else f"/{op_type}"
        count = self._names.get(base, 0)
        self._names[base] = count + 1
        name = base if count == 0 else f"{base}_{count}"
        # short tensor names keep the files small; the node name carries the scope
        outputs = [f"t{len(self.nodes)}" + (f"_{i}" if i else "") for i in range(n_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, **attrs))
        return outputs[0] if n_outputs == 1 else outputs

    def const(self, scope: str, values: list[int]) -> str:
        """A 1-D int64 ``Constant`` node (shapes, axes, indices): never a parameter."""
        tensor = helper.make_tensor("value", I64, [len(values)], values)
        return self.node(scope, "Constant", [], value=tensor)

    def output(self, tensor: str, name: str, shape: list, elem_type: int | None = None) -> None:
        """Rename ``tensor`` (the output of the last node) to ``name`` and make it a graph output."""
        last = self.nodes[-1]
        assert list(last.output) == [tensor], "a graph output must be the last node's only output"
        last.output[0] = name
        elem = self.dtype if elem_type is None else elem_type
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def model(self, default_dims: dict[str, int], doc: str) -> onnx.ModelProto:
        """The finished ModelProto, with the opsched metadata keys set."""
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="opsched models/build.py",
            doc_string=doc,
        )
        props = {
            "opsched.default_dims": ",".join(f"{k}={v}" for k, v in default_dims.items()),
            "opsched.data_inputs": ",".join(self.data_inputs),
            "opsched.param_count": str(self.param_count),
        }
        if self.moe:
            # a hint for readers and importers; the graph itself carries the same facts
            props["opsched.moe"] = ";".join(f"experts={e},top_k={k}" for e, k in sorted(self.moe))
        helper.set_model_props(model, props)
        return model


# ---------------------------------------------------------------- layers


def linear(b: GraphBuilder, scope: str, x: str, d_in: int, d_out: int, bias: bool = False) -> str:
    """``x @ W (+ bias)`` with ``W`` of shape ``[d_in, d_out]`` (the exported orientation)."""
    y = b.node(scope, "MatMul", [x, b.weight(scope, "weight", [d_in, d_out])])
    if bias:
        y = b.node(scope, "Add", [y, b.weight(scope, "bias", [d_out])])
    return y


def rms_norm(b: GraphBuilder, scope: str, x: str, dim: int, eps: float = 1e-5) -> str:
    """RMSNorm over the last axis with a learned scale (Llama, Mixtral, T5)."""
    scale = b.weight(scope, "weight", [dim])
    return b.node(scope, "RMSNormalization", [x, scale], axis=-1, epsilon=eps)


def layer_norm(b: GraphBuilder, scope: str, x: str, dim: int, eps: float = 1e-5, bias: bool = True) -> str:
    """LayerNorm over the last axis with a learned scale and (unless ``bias=False``, as in MPT) bias (CLIP)."""
    inputs = [x, b.weight(scope, "weight", [dim])]
    if bias:
        inputs.append(b.weight(scope, "bias", [dim]))
    return b.node(scope, "LayerNormalization", inputs, axis=-1, epsilon=eps)


def embedding(b: GraphBuilder, scope: str, ids: str, vocab: int, dim: int) -> str:
    """Token embedding lookup: ``Gather(weight[vocab, dim], ids)``."""
    return b.node(scope, "Gather", [b.weight(scope, "weight", [vocab, dim]), ids], axis=0)


def silu(b: GraphBuilder, scope: str, x: str) -> str:
    """``x * sigmoid(x)`` (ONNX has no SiLU operator)."""
    return b.node(scope, "Mul", [x, b.node(scope, "Sigmoid", [x])])


def quick_gelu(b: GraphBuilder, scope: str, x: str) -> str:
    """CLIP's activation, ``x * sigmoid(1.702 x)``."""
    k = b.node(scope, "Constant", [], value=helper.make_tensor("value", b.dtype, [], [1.702]))
    return b.node(scope, "Mul", [x, b.node(scope, "Sigmoid", [b.node(scope, "Mul", [x, k])])])


def attention(
    b: GraphBuilder,
    scope: str,
    x: str,
    dim: int,
    heads: int,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    causal: bool = True,
    bias: bool = False,
    names: tuple[str, str, str, str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    kv_source: str | None = None,
    scale: float | None = None,
) -> str:
    """Multi-head (or grouped-query) attention: projections, opset-23 ``Attention``, output.

    ``kv_source`` gives cross-attention (keys and values from another sequence).
    """
    kv_heads = heads if kv_heads is None else kv_heads
    head_dim = dim // heads if head_dim is None else head_dim
    kv_in = x if kv_source is None else kv_source
    q = linear(b, f"{scope}/{names[0]}", x, dim, heads * head_dim, bias)
    k = linear(b, f"{scope}/{names[1]}", kv_in, dim, kv_heads * head_dim, bias)
    v = linear(b, f"{scope}/{names[2]}", kv_in, dim, kv_heads * head_dim, bias)
    attrs = {"q_num_heads": heads, "kv_num_heads": kv_heads, "is_causal": int(causal)}
    if scale is not None:
        attrs["scale"] = scale
    a = b.node(scope, "Attention", [q, k, v], **attrs)
    return linear(b, f"{scope}/{names[3]}", a, heads * head_dim, dim, bias)


def mla_attention(
    b: GraphBuilder,
    scope: str,
    x: str,
    dim: int,
    heads: int,
    q_rank: int,
    kv_rank: int,
    nope_dim: int,
    rope_dim: int,
    v_dim: int,
    eps: float = 1e-6,
) -> str:
    """Multi-head latent attention (DeepSeek-V2/V3), with the Hugging Face module names.

    Queries go through a low-rank bottleneck (``q_a_proj`` to ``q_rank``,
    RMSNorm, ``q_b_proj`` to ``heads x (nope_dim + rope_dim)``). Keys and values
    share one latent: ``kv_a_proj_with_mqa`` gives ``kv_rank`` latent features
    plus one ``rope_dim`` key part shared by all heads; the latent is normed and
    ``kv_b_proj`` expands it to each head's ``nope_dim`` key part and ``v_dim``
    value. A head's key is its own part followed by the shared one (``Expand``
    to every head, ``Concat``); opset-23 ``Attention`` takes value heads of a
    different width than query/key heads. RoPE itself has no parameters and is
    left out, as in the other models.
    """
    qk_dim = nope_dim + rope_dim
    q = linear(b, f"{scope}/q_a_proj", x, dim, q_rank)
    q = rms_norm(b, f"{scope}/q_a_layernorm", q, q_rank, eps)
    q = linear(b, f"{scope}/q_b_proj", q, q_rank, heads * qk_dim)
    kv_a = linear(b, f"{scope}/kv_a_proj_with_mqa", x, dim, kv_rank + rope_dim)
    latent, k_rope = b.node(scope, "Split", [kv_a, b.const(scope, [kv_rank, rope_dim])], n_outputs=2, axis=-1)
    latent = rms_norm(b, f"{scope}/kv_a_layernorm", latent, kv_rank, eps)
    kv = linear(b, f"{scope}/kv_b_proj", latent, kv_rank, heads * (nope_dim + v_dim))
    kv = b.node(scope, "Reshape", [kv, b.const(scope, [0, 0, heads, nope_dim + v_dim])])
    k_nope, v = b.node(scope, "Split", [kv, b.const(scope, [nope_dim, v_dim])], n_outputs=2, axis=-1)
    k_rope = b.node(scope, "Unsqueeze", [k_rope, b.const(scope, [2])])  # [batch, seq, 1, rope_dim]
    k_rope = b.node(scope, "Expand", [k_rope, b.const(scope, [1, 1, heads, 1])])
    k = b.node(scope, "Concat", [k_nope, k_rope], axis=-1)
    k = b.node(scope, "Reshape", [k, b.const(scope, [0, 0, heads * qk_dim])])
    v = b.node(scope, "Reshape", [v, b.const(scope, [0, 0, heads * v_dim])])
    a = b.node(scope, "Attention", [q, k, v], q_num_heads=heads, kv_num_heads=heads, is_causal=1)
    return linear(b, f"{scope}/o_proj", a, heads * v_dim, dim)


def swiglu_mlp(
    b: GraphBuilder,
    scope: str,
    x: str,
    dim: int,
    ff: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> str:
    """Llama-style gated MLP: ``down(silu(gate(x)) * up(x))``."""
    gate = silu(b, scope, linear(b, f"{scope}/{names[0]}", x, dim, ff))
    up = linear(b, f"{scope}/{names[1]}", x, dim, ff)
    return linear(b, f"{scope}/{names[2]}", b.node(scope, "Mul", [gate, up]), ff, dim)


def relu_mlp(b: GraphBuilder, scope: str, x: str, dim: int, ff: int) -> str:
    """T5 v1.0 feed-forward (Switch Transformer experts): ``wo(relu(wi(x)))``, no biases."""
    h = b.node(scope, "Relu", [linear(b, f"{scope}/wi", x, dim, ff)])
    return linear(b, f"{scope}/wo", h, ff, dim)


def gelu_mlp(b: GraphBuilder, scope: str, x: str, dim: int, ff: int, quick: bool = True) -> str:
    """Two-layer MLP with biases, ``fc2(act(fc1(x)))`` (CLIP encoders)."""
    h = linear(b, f"{scope}/fc1", x, dim, ff, bias=True)
    h = quick_gelu(b, scope, h) if quick else b.node(scope, "Gelu", [h])
    return linear(b, f"{scope}/fc2", h, ff, dim, bias=True)


def softmax_top_k(b: GraphBuilder, scope: str, logits: str, experts: int, top_k: int, normalize: bool) -> tuple[str, str]:
    """Mixtral / DeepSeek-MoE / Switch router: ``TopK(softmax(logits))`` in float32, optionally renormalised."""
    probs = b.node(scope, "Softmax", [b.node(scope, "Cast", [logits], to=F32)], axis=-1)
    top_w, top_i = b.node(scope, "TopK", [probs, b.const(scope, [top_k])], n_outputs=2, axis=-1)
    if normalize:
        total = b.node(scope, "ReduceSum", [top_w, b.const(scope, [-1])], keepdims=1)
        top_w = b.node(scope, "Div", [top_w, total])
    return top_w, top_i


def sigmoid_top_k(scaling: float, gate_name: str = "gate"):
    """DeepSeek-V3's router (a ``router`` for :func:`moe_layer`), with ``routed_scaling_factor`` ``scaling``.

    Scores are ``sigmoid(logits)`` in float32; experts are chosen by ``TopK`` of
    the scores plus a learned per-expert bias (``e_score_correction_bias``, used
    for the choice only), and weighted by their own scores, renormalised over the
    chosen k and multiplied by ``scaling``. Group-limited routing (top 4 of 8
    expert groups first) is left out: it has no parameters, a few hundred FLOPs
    per token, and the same number of experts per token.
    """

    def route(b: GraphBuilder, scope: str, logits: str, experts: int, top_k: int, normalize: bool) -> tuple[str, str]:
        scores = b.node(scope, "Sigmoid", [b.node(scope, "Cast", [logits], to=F32)])
        experts_bias = b.weight(f"{scope}/{gate_name}", "e_score_correction_bias", [experts], F32)
        choice = b.node(scope, "Add", [scores, experts_bias])
        _, top_i = b.node(scope, "TopK", [choice, b.const(scope, [top_k])], n_outputs=2, axis=-1)
        top_w = b.node(scope, "GatherElements", [scores, top_i], axis=-1)
        if normalize:
            total = b.node(scope, "ReduceSum", [top_w, b.const(scope, [-1])], keepdims=1)
            top_w = b.node(scope, "Div", [top_w, total])
        factor = b.node(scope, "Constant", [], value=helper.make_tensor("value", F32, [], [scaling]))
        return b.node(scope, "Mul", [top_w, factor]), top_i

    return route


def moe_layer(
    b: GraphBuilder,
    scope: str,
    x: str,
    residual: str,
    dim: int,
    experts: int,
    top_k: int,
    expert_fn,
    gate_name: str = "gate",
    normalize_top_k: bool = True,
    router=None,
) -> str:
    """A routed mixture-of-experts layer; returns ``residual + sum_e w_e * expert_e(x)``.

    Router (float32): ``router(b, scope, logits, experts, top_k, normalize_top_k)`` on
    ``x @ W_gate`` gives the chosen experts' weights and indices; the default,
    :func:`softmax_top_k`, is ``softmax``, ``TopK``, optionally renormalised
    over the chosen k. The dense weight matrix ``[batch, seq, experts]`` (zero
    where an expert is not chosen) is split per expert; each expert gathers
    the tokens with a non-zero weight (``NonZero`` -> ``GatherND``), runs
    ``expert_fn(b, scope_of_expert, tokens)`` on ``[tokens_e, dim]``, scales by
    its weight, and one ``ScatterND(reduction="add")`` adds every expert's
    output onto the residual stream. Experts share no node, so they are
    parallel branches; only ``tokens_e`` is data-dependent.
    """
    b.moe.add((experts, top_k))
    logits = linear(b, f"{scope}/{gate_name}", x, dim, experts)
    top_w, top_i = (router or softmax_top_k)(b, scope, logits, experts, top_k, normalize_top_k)
    # one-hot of the chosen experts, weighted: [batch, seq, k, experts] -> [batch, seq, experts]
    last = b.const(scope, [-1])
    chosen = b.node(
        scope, "Equal", [b.node(scope, "Unsqueeze", [top_i, last]), b.const(scope, list(range(experts)))]
    )
    chosen = b.node(scope, "Cast", [chosen], to=F32)
    weighted = b.node(scope, "Mul", [chosen, b.node(scope, "Unsqueeze", [top_w, last])])
    dense_w = b.node(scope, "ReduceSum", [weighted, b.const(scope, [2])], keepdims=0)
    dense_w = b.node(scope, "Cast", [dense_w], to=b.dtype)
    per_expert = b.node(scope, "Split", [dense_w], n_outputs=experts, axis=2, num_outputs=experts)
    if experts == 1:
        per_expert = [per_expert]
    axis2 = b.const(scope, [2])
    axis1 = b.const(scope, [1])
    x4 = b.node(scope, "Unsqueeze", [x, axis2])  # [batch, seq, 1, dim], indexed by [N, 3]
    indices, updates = [], []
    for e in range(experts):
        idx = b.node(scope, "Transpose", [b.node(scope, "NonZero", [per_expert[e]])], perm=[1, 0])
        tokens = b.node(scope, "GatherND", [x4, idx])
        w = b.node(scope, "Unsqueeze", [b.node(scope, "GatherND", [per_expert[e], idx]), axis1])
        y = expert_fn(b, f"{scope}/experts.{e}", tokens)
        indices.append(idx)
        updates.append(b.node(scope, "Mul", [y, w]))
    all_idx = b.node(scope, "Concat", indices, axis=0)
    all_upd = b.node(scope, "Concat", updates, axis=0)
    base = b.node(scope, "Unsqueeze", [residual, axis2])
    out = b.node(scope, "ScatterND", [base, all_idx, all_upd], reduction="add")
    return b.node(scope, "Squeeze", [out, axis2])


# ---------------------------------------------------------------- decoder LMs


def decoder_lm(
    b: GraphBuilder,
    prefix: str,
    h: str,
    *,
    layers: int,
    dim: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    mlp_fn,
    mlp_name: str = "mlp",
    head_scope: str = "lm_head",
    eps: float = 1e-5,
    attn_fn=None,
    hidden_out: list[str] | None = None,
) -> str:
    """Llama-family decoder stack on embeddings ``h``; returns the logits.

    ``mlp_fn(b, scope, x_normed, residual, layer)`` returns the layer output
    *including* the residual (MoE layers fuse it into their scatter-add).
    ``attn_fn(b, scope, x_normed)`` replaces the (grouped-query) attention of
    ``heads`` / ``kv_heads`` heads, e.g. with :func:`mla_attention`.
    ``hidden_out``: a list the last layer's output (before the final norm) is
    appended to, for a multi-token-prediction module to continue from.
    """
    for i in range(layers):
        h = decoder_layer(b, f"{prefix}/layers.{i}", h, i, dim=dim, heads=heads, kv_heads=kv_heads, mlp_fn=mlp_fn,
                          mlp_name=mlp_name, eps=eps, attn_fn=attn_fn)
    if hidden_out is not None:
        hidden_out.append(h)
    h = rms_norm(b, f"{prefix}/norm", h, dim, eps)
    return linear(b, head_scope, h, dim, vocab)


def decoder_layer(b: GraphBuilder, scope: str, h: str, i: int, *, dim: int, heads: int, kv_heads: int, mlp_fn,
                  mlp_name: str = "mlp", eps: float = 1e-5, attn_fn=None) -> str:
    """One pre-norm decoder layer of :func:`decoder_lm` (layer number ``i`` for ``mlp_fn``) on ``h``."""
    normed = rms_norm(b, f"{scope}/input_layernorm", h, dim, eps)
    if attn_fn is None:
        a = attention(b, f"{scope}/self_attn", normed, dim, heads, kv_heads)
    else:
        a = attn_fn(b, f"{scope}/self_attn", normed)
    h = b.node(scope, "Add", [h, a])
    normed = rms_norm(b, f"{scope}/post_attention_layernorm", h, dim, eps)
    return mlp_fn(b, f"{scope}/{mlp_name}", normed, h, i)


def dense_mlp(dim: int, ff: int):
    """An ``mlp_fn`` for :func:`decoder_lm`: SwiGLU MLP plus residual."""

    def mlp(b, scope, x, residual, layer):
        return b.node(scope.rsplit("/", 1)[0], "Add", [residual, swiglu_mlp(b, scope, x, dim, ff)])

    return mlp


def build_llama_7b() -> onnx.ModelProto:
    """Llama-2-7B: 32 layers, d=4096, 32 heads, SwiGLU FFN 11008, vocab 32000 (6.74 B)."""
    b = GraphBuilder("llama_7b")
    ids = b.data("input_ids", ["batch", "seq"], I64)
    h = embedding(b, "model/embed_tokens", ids, 32000, 4096)
    logits = decoder_lm(b, "model", h, layers=32, dim=4096, heads=32, kv_heads=32, vocab=32000, mlp_fn=dense_mlp(4096, 11008))
    b.output(logits, "logits", ["batch", "seq", 32000])
    return b.model({"batch": 1, "seq": 4096}, build_llama_7b.__doc__)


def _llama3(name: str, doc: str, *, layers: int, dim: int, heads: int, ffn: int) -> onnx.ModelProto:
    """A Llama 3 model: GQA with 8 KV heads, SwiGLU, vocab 128256, untied embeddings, default seq 8192."""
    b = GraphBuilder(name)
    vocab = 128256
    ids = b.data("input_ids", ["batch", "seq"], I64)
    h = embedding(b, "model/embed_tokens", ids, vocab, dim)
    logits = decoder_lm(b, "model", h, layers=layers, dim=dim, heads=heads, kv_heads=8, vocab=vocab,
                        mlp_fn=dense_mlp(dim, ffn))
    b.output(logits, "logits", ["batch", "seq", vocab])
    return b.model({"batch": 1, "seq": 8192}, doc)


def build_llama3_8b() -> onnx.ModelProto:
    """Llama-3.1-8B: 32 layers, d=4096, GQA 32/8 heads of 128, SwiGLU FFN 14336, vocab 128256,
    untied embeddings (8.03 B)."""
    # meta-llama/Llama-3.1-8B config.json: hidden_size 4096, intermediate_size 14336,
    # num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 8, vocab_size 128256,
    # tie_word_embeddings false, rms_norm_eps 1e-05; 8,030,261,248 parameters.
    return _llama3("llama3_8b", build_llama3_8b.__doc__, layers=32, dim=4096, heads=32, ffn=14336)


def mpt(name: str, layers: int, dim: int, heads: int, vocab: int, doc: str) -> onnx.ModelProto:
    """An MPT decoder: ``layers`` blocks of width ``dim`` with ``heads`` heads behind one fused Wqkv, ALiBi,
    GELU FFN 4 x dim (not gated), LayerNorm without bias, no linear biases, output tied to the token embedding."""
    # ALiBi adds a fixed per-head bias to the attention scores: no parameters and one add per score, left out
    # like RoPE. Names follow transformers' MptForCausalLM.
    b = GraphBuilder(name)
    ff = 4 * dim
    ids = b.data("input_ids", ["batch", "seq"], I64)
    wte = b.weight("transformer/wte", "weight", [vocab, dim])
    h = b.node("transformer/wte", "Gather", [wte, ids], axis=0)
    for i in range(layers):
        scope = f"transformer/blocks.{i}"
        x = layer_norm(b, f"{scope}/norm_1", h, dim, bias=False)
        qkv = linear(b, f"{scope}/attn/Wqkv", x, dim, 3 * dim)
        q, k, v = b.node(f"{scope}/attn", "Split", [qkv, b.const(f"{scope}/attn", [dim] * 3)], n_outputs=3, axis=-1)
        a = b.node(f"{scope}/attn", "Attention", [q, k, v], q_num_heads=heads, kv_num_heads=heads, is_causal=1)
        h = b.node(scope, "Add", [h, linear(b, f"{scope}/attn/out_proj", a, dim, dim)])
        x = layer_norm(b, f"{scope}/norm_2", h, dim, bias=False)
        up = b.node(f"{scope}/ffn", "Gelu", [linear(b, f"{scope}/ffn/up_proj", x, dim, ff)])
        h = b.node(scope, "Add", [h, linear(b, f"{scope}/ffn/down_proj", up, ff, dim)])
    h = layer_norm(b, "transformer/norm_f", h, dim, bias=False)
    w_t = b.node("lm_head", "Transpose", [wte], perm=[1, 0])  # tied: logits = h @ wte^T
    logits = b.node("lm_head", "MatMul", [h, w_t])
    b.output(logits, "logits", ["batch", "seq", vocab])
    return b.model({"batch": 1, "seq": 4096}, doc)


def build_mpt_7b() -> onnx.ModelProto:
    """MPT-7B: 32 layers, d=4096, 32 heads of 128 (no GQA) with one fused Wqkv projection, ALiBi,
    GELU FFN 16384 (not gated), LayerNorm without bias, no linear biases, vocab 50432, output
    projection tied to the token embedding (6.65 B)."""
    # mosaicml/mpt-7b config.json: d_model 4096, n_heads 32, n_layers 32, expansion_ratio 4,
    # vocab_size 50432, no_bias true (drops every bias, LayerNorm's included), attn_config.alibi
    # true (which turns learned_pos_emb off), norm_type low_precision_layernorm; the logits
    # reuse wte.
    return mpt("mpt_7b", 32, 4096, 32, 50432, build_mpt_7b.__doc__)


# llm-foundry's training benchmarks (scripts/train/benchmarking/README.md) run the MPT sizes of
# scripts/train/yamls/pretrain/mpt-{13b,30b}.yaml: d_model, n_heads, n_layers as below, expansion
# ratio 4, vocab_size 50368, FlashAttention. Those configurations keep learned position embeddings
# (max_seq_len x d_model, the NumParams column grows with the sequence: 0.2 % of the 13B at 4096)
# where MPT-7B's release has ALiBi; they are left out here, as ALiBi's none.


def build_mpt_13b() -> onnx.ModelProto:
    """MPT-13B of llm-foundry's benchmarks: 40 layers, d=5120, 40 heads of 128, vocab 50368 (12.84 B)."""
    return mpt("mpt_13b", 40, 5120, 40, 50368, build_mpt_13b.__doc__)


def build_mpt_30b() -> onnx.ModelProto:
    """MPT-30B of llm-foundry's benchmarks: 48 layers, d=7168, 56 heads of 128, vocab 50368 (29.96 B)."""
    return mpt("mpt_30b", 48, 7168, 56, 50368, build_mpt_30b.__doc__)


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM" (SC'21), Table 1: GPT models as Megatron-LM defines them, sized by
# examples/sc21/run_table_1.sh (layers, hidden, heads) and the README beside it (vocab 51200,
# sequence 2048). Megatron's GPTModel of that time (megatron/model/{gpt_model,language_model,
# transformer}.py): word plus learned position embeddings (max_position_embeddings = 2048);
# pre-LayerNorm layers (LayerNorm with bias, eps 1e-5) with a fused query_key_value projection
# and a dense output projection, an MLP dense_h_to_4h -> GeLU -> dense_4h_to_h (ffn_hidden_size
# 4h), every linear with a bias; final_layernorm; logits = h @ word_embeddings^T (tied, no
# bias). The fused bias-GeLU kernel uses the tanh approximation. Dropout has no parameters and
# is left out. The runs were --fp16, so these graphs are float16 (same bytes as bfloat16).
# Names follow Megatron's state dict, language_model.encoder.layers.3.mlp.dense_h_to_4h.weight,
# with linear weights [in, out] as in the other models.


def megatron_gpt(name: str, layers: int, dim: int, heads: int, doc: str, vocab: int = 51200,
                 max_positions: int = 2048, seq: int = 2048, tied: bool = True, dtype: int = F16) -> onnx.ModelProto:
    """A Megatron-LM GPT (see the note above) of ``layers`` layers, hidden ``dim``, ``heads`` heads, FFN 4 x dim.

    ``tied=False`` gives the logits their own ``output_layer`` weight (Megatron's
    ``--untie-embeddings-and-output-weights``); ``dtype`` is that of weights and activations.
    """
    b = GraphBuilder(name, dtype=dtype)
    ids = b.data("input_ids", ["batch", "seq"], I64)
    positions = b.data("position_ids", ["batch", "seq"], I64)  # built by the data loader, as in Megatron
    emb = "language_model/embedding"
    words = b.weight(f"{emb}/word_embeddings", "weight", [vocab, dim])
    h = b.node(f"{emb}/word_embeddings", "Gather", [words, ids], axis=0)
    h = b.node(emb, "Add", [h, embedding(b, f"{emb}/position_embeddings", positions, max_positions, dim)])
    for i in range(layers):
        h = megatron_layer(b, f"language_model/encoder/layers.{i}", h, dim, heads)
    h = layer_norm(b, "language_model/encoder/final_layernorm", h, dim)
    if tied:
        w_t = b.node("lm_head", "Transpose", [words], perm=[1, 0])  # tied: logits = h @ word_embeddings^T
        logits = b.node("lm_head", "MatMul", [h, w_t])
    else:
        logits = linear(b, "language_model/output_layer", h, dim, vocab)
    b.output(logits, "logits", ["batch", "seq", vocab])
    return b.model({"batch": 1, "seq": seq}, doc)


def build_gpt_1_7b() -> onnx.ModelProto:
    """GPT 1.7B of SC'21 Table 1 (Megatron-LM): 24 layers, h=2304, 24 heads, GeLU FFN 4h, learned positions
    (2048), vocab 51200, LayerNorm and linear biases, tied output embedding (1.65 B)."""
    return megatron_gpt("gpt_1_7b", 24, 2304, 24, build_gpt_1_7b.__doc__)


def build_gpt_3_6b() -> onnx.ModelProto:
    """GPT 3.6B of SC'21 Table 1 (Megatron-LM): 30 layers, h=3072, 32 heads, otherwise as gpt_1_7b (3.56 B)."""
    return megatron_gpt("gpt_3_6b", 30, 3072, 32, build_gpt_3_6b.__doc__)


def build_gpt_7_5b() -> onnx.ModelProto:
    """GPT 7.5B of SC'21 Table 1 (Megatron-LM): 36 layers, h=4096, 32 heads, otherwise as gpt_1_7b (7.47 B)."""
    return megatron_gpt("gpt_7_5b", 36, 4096, 32, build_gpt_7_5b.__doc__)


def build_gpt_18_4b() -> onnx.ModelProto:
    """GPT 18.4B of SC'21 Table 1 (Megatron-LM): 40 layers, h=6144, 48 heads, otherwise as gpt_1_7b (18.45 B)."""
    return megatron_gpt("gpt_18_4b", 40, 6144, 48, build_gpt_18_4b.__doc__)


def build_gpt_39_1b() -> onnx.ModelProto:
    """GPT 39.1B of SC'21 Table 1 (Megatron-LM): 48 layers, h=8192, 64 heads, otherwise as gpt_1_7b (39.14 B)."""
    return megatron_gpt("gpt_39_1b", 48, 8192, 64, build_gpt_39_1b.__doc__)


def build_gpt_76_1b() -> onnx.ModelProto:
    """GPT 76.1B of SC'21 Table 1 (Megatron-LM): 60 layers, h=10240, 80 heads, otherwise as gpt_1_7b (76.09 B)."""
    return megatron_gpt("gpt_76_1b", 60, 10240, 80, build_gpt_76_1b.__doc__)


def build_gpt_145_6b() -> onnx.ModelProto:
    """GPT 145.6B of SC'21 Table 1 (Megatron-LM): 80 layers, h=12288, 96 heads, otherwise as gpt_1_7b (145.6 B)."""
    return megatron_gpt("gpt_145_6b", 80, 12288, 96, build_gpt_145_6b.__doc__)


def build_gpt_310_1b() -> onnx.ModelProto:
    """GPT 310.1B of SC'21 Table 1 (Megatron-LM): 96 layers, h=16384, 128 heads, otherwise as gpt_1_7b (310.1 B)."""
    return megatron_gpt("gpt_310_1b", 96, 16384, 128, build_gpt_310_1b.__doc__)


def build_gpt_529_6b() -> onnx.ModelProto:
    """GPT 529.6B of SC'21 Table 1 (Megatron-LM): 105 layers, h=20480, 128 heads, otherwise as gpt_1_7b (529.6 B)."""
    return megatron_gpt("gpt_529_6b", 105, 20480, 128, build_gpt_529_6b.__doc__)


def build_gpt_1008b() -> onnx.ModelProto:
    """GPT 1008B of SC'21 Table 1 (Megatron-LM): 128 layers, h=25600, 160 heads, otherwise as gpt_1_7b (1008 B)."""
    return megatron_gpt("gpt_1008b", 128, 25600, 160, build_gpt_1008b.__doc__)


# Megatron-Core r0.8 weak scaling on H100 (Megatron-LM README, images/model_table.png @ f2e5db40):
# the README gives each GPT's layers, hidden size and heads, a vocabulary of 131,072 and sequences
# of 4096, nothing else about the architecture. The table's sizes need untied embeddings: 12 L h^2
# + 2 V h gives 1.74 / 7.11 / 16.11 / 69.79 B for the 1.7 / 7.1 / 16 / 70 B rows, one tied
# embedding 1.48 / 6.57 / 15.3 / 68.7 B. Everything else is Megatron-LM's argument default
# (megatron/training/arguments.py: --normalization LayerNorm, --position-embedding-type
# learned_absolute, linear biases on, GeLU FFN 4h), which gives the same 12 h^2 per layer; a
# SwiGLU FFN of 8h/3 or RoPE would give the same matmul FLOPs. The precision is not stated either:
# the MFU column is TFLOP/s / 989, the H100's dense BF16 peak, so the graphs are bfloat16.
MCORE_R08_GPT = {  # name: (layers, hidden, heads)
    "mcore_gpt_1_7b": (24, 2048, 16),
    "mcore_gpt_7_1b": (30, 4096, 32),
    "mcore_gpt_16b": (32, 6144, 48),
    "mcore_gpt_32b": (48, 7168, 56),
    "mcore_gpt_70b": (84, 8192, 64),
    "mcore_gpt_119b": (92, 10240, 80),
    "mcore_gpt_177b": (96, 12288, 96),
    "mcore_gpt_314b": (96, 16384, 128),
    "mcore_gpt_462b": (112, 18432, 144),
}


def mcore_r08_gpt(name: str) -> onnx.ModelProto:
    """One GPT of the Megatron-Core r0.8 weak-scaling table: vocab 131072, sequence 4096, untied embeddings."""
    layers, dim, heads = MCORE_R08_GPT[name]
    doc = (f"GPT of Megatron-Core r0.8's H100 weak-scaling table: {layers} layers, h={dim}, {heads} heads, GeLU "
           "FFN 4h, learned positions (4096), vocab 131072, LayerNorm and linear biases, untied output layer, "
           "bfloat16 (Megatron-LM's defaults where the README is silent).")
    return megatron_gpt(name, layers, dim, heads, doc, vocab=131072, max_positions=4096, seq=4096, tied=False,
                        dtype=BF16)


def build_bloom_176b() -> onnx.ModelProto:
    """BLOOM-176B: 70 layers, h=14336, 112 heads, ALiBi (no position parameters, left out), LayerNorm after the
    embedding, fused query_key_value, GeLU FFN 4h, biases everywhere, vocab 250880, tied output (176.25 B)."""
    # bigscience/bloom config.json: n_layer 70, hidden_size 14336, n_head 112, vocab_size 250880,
    # layer_norm_epsilon 1e-5; transformers' BloomModel: word_embeddings -> word_embeddings_layernorm,
    # pre-LayerNorm blocks (input_layernorm, self_attention.query_key_value / dense,
    # post_attention_layernorm, mlp.dense_h_to_4h -> GeLU (tanh form) -> dense_4h_to_h, every linear
    # with a bias), ln_f, logits from the word embeddings (tied). ALiBi adds a fixed per-head bias to
    # the scores: no parameters, left out as for MPT. 176,247,271,424 parameters. Trained in bfloat16.
    b = GraphBuilder("bloom_176b")
    dim, heads, vocab = 14336, 112, 250880
    ids = b.data("input_ids", ["batch", "seq"], I64)
    words = b.weight("transformer/word_embeddings", "weight", [vocab, dim])
    h = b.node("transformer/word_embeddings", "Gather", [words, ids], axis=0)
    h = layer_norm(b, "transformer/word_embeddings_layernorm", h, dim)
    for i in range(70):
        scope = f"transformer/h.{i}"
        attn = f"{scope}/self_attention"
        x = layer_norm(b, f"{scope}/input_layernorm", h, dim)
        qkv = linear(b, f"{attn}/query_key_value", x, dim, 3 * dim, bias=True)
        q, k, v = b.node(attn, "Split", [qkv, b.const(attn, [dim] * 3)], n_outputs=3, axis=-1)
        a = b.node(attn, "Attention", [q, k, v], q_num_heads=heads, kv_num_heads=heads, is_causal=1)
        h = b.node(scope, "Add", [h, linear(b, f"{attn}/dense", a, dim, dim, bias=True)])
        x = layer_norm(b, f"{scope}/post_attention_layernorm", h, dim)
        up = b.node(f"{scope}/mlp", "Gelu", [linear(b, f"{scope}/mlp/dense_h_to_4h", x, dim, 4 * dim, bias=True)],
                    approximate="tanh")
        h = b.node(scope, "Add", [h, linear(b, f"{scope}/mlp/dense_4h_to_h", up, 4 * dim, dim, bias=True)])
    h = layer_norm(b, "transformer/ln_f", h, dim)
    w_t = b.node("lm_head", "Transpose", [words], perm=[1, 0])  # tied: logits = h @ word_embeddings^T
    logits = b.node("lm_head", "MatMul", [h, w_t])
    b.output(logits, "logits", ["batch", "seq", vocab])
    return b.model({"batch": 1, "seq": 2048}, build_bloom_176b.__doc__)


def build_mixtral_8x7b() -> onnx.ModelProto:
    """Mixtral-8x7B: 32 layers, d=4096, GQA 32/8 heads, 8 SwiGLU experts (FFN 14336) top-2, vocab 32000 (46.7 B)."""
    b = GraphBuilder("mixtral_8x7b")
    ids = b.data("input_ids", ["batch", "seq"], I64)
    h = embedding(b, "model/embed_tokens", ids, 32000, 4096)

    def expert(b, scope, t):
        return swiglu_mlp(b, scope, t, 4096, 14336, names=("w1", "w3", "w2"))

    def mlp(b, scope, x, residual, layer):
        return moe_layer(b, scope, x, residual, 4096, 8, 2, expert, normalize_top_k=True)

    logits = decoder_lm(
        b, "model", h, layers=32, dim=4096, heads=32, kv_heads=8, vocab=32000, mlp_fn=mlp, mlp_name="block_sparse_moe"
    )
    b.output(logits, "logits", ["batch", "seq", 32000])
    return b.model({"batch": 1, "seq": 4096}, build_mixtral_8x7b.__doc__)


def build_deepseek_moe() -> onnx.ModelProto:
    """DeepSeek-MoE-16B: 28 layers, d=2048, 16 heads; layer 0 dense (FFN 10944); layers 1-27:
    2 shared experts (one fused SwiGLU MLP of 2x1408) + 64 routed SwiGLU experts (1408) top-6; vocab 102400 (16.4 B)."""
    b = GraphBuilder("deepseek_moe")
    dim = 2048
    ids = b.data("input_ids", ["batch", "seq"], I64)
    h = embedding(b, "model/embed_tokens", ids, 102400, dim)
    dense = dense_mlp(dim, 10944)

    def expert(b, scope, t):
        return swiglu_mlp(b, scope, t, dim, 1408)

    def mlp(b, scope, x, residual, layer):
        if layer == 0:
            return dense(b, scope, x, residual, layer)
        shared = swiglu_mlp(b, f"{scope}/shared_experts", x, dim, 2 * 1408)
        base = b.node(scope.rsplit("/", 1)[0], "Add", [residual, shared])
        return moe_layer(b, scope, x, base, dim, 64, 6, expert, normalize_top_k=False)

    logits = decoder_lm(b, "model", h, layers=28, dim=dim, heads=16, kv_heads=16, vocab=102400, mlp_fn=mlp, eps=1e-6)
    b.output(logits, "logits", ["batch", "seq", 102400])
    return b.model({"batch": 1, "seq": 4096}, build_deepseek_moe.__doc__)


# ---------------------------------------------------------------- Switch (encoder-decoder, top-1)


def build_switch_moe() -> onnx.ModelProto:
    """Switch-Base-8: T5-base encoder-decoder (12+12 layers, d=768, 12 heads, ReLU FFN 3072, vocab 32128,
    tied embeddings); every other FFN (layers 1, 3, ..., 11 of each stack) is a top-1 MoE of 8 experts (0.62 B)."""
    b = GraphBuilder("switch_moe")
    dim, ff, heads, vocab, experts = 768, 3072, 12, 32128, 8
    enc_ids = b.data("input_ids", ["batch", "seq"], I64)
    dec_ids = b.data("decoder_input_ids", ["batch", "dec_seq"], I64)
    shared = b.weight("shared", "weight", [vocab, dim])
    t5_attn = {"names": ("q", "k", "v", "o"), "scale": 1.0}  # T5 folds 1/sqrt(d) into its init

    def expert(b, scope, t):
        return relu_mlp(b, scope, t, dim, ff)

    def ff_layer(scope, h, i):
        normed = rms_norm(b, f"{scope}/layer_norm", h, dim, 1e-6)
        if i % 2 == 1:
            return moe_layer(b, f"{scope}/mlp", normed, h, dim, experts, 1, expert, "router/classifier", False)
        return b.node(scope, "Add", [h, relu_mlp(b, f"{scope}/mlp", normed, dim, ff)])

    h = b.node("encoder/embed_tokens", "Gather", [shared, enc_ids], axis=0)
    for i in range(12):
        scope = f"encoder/block.{i}"
        normed = rms_norm(b, f"{scope}/layer.0/layer_norm", h, dim, 1e-6)
        a = attention(b, f"{scope}/layer.0/SelfAttention", normed, dim, heads, causal=False, **t5_attn)
        h = b.node(f"{scope}/layer.0", "Add", [h, a])
        h = ff_layer(f"{scope}/layer.1", h, i)
    memory = rms_norm(b, "encoder/final_layer_norm", h, dim, 1e-6)

    h = b.node("decoder/embed_tokens", "Gather", [shared, dec_ids], axis=0)
    for i in range(12):
        scope = f"decoder/block.{i}"
        normed = rms_norm(b, f"{scope}/layer.0/layer_norm", h, dim, 1e-6)
        a = attention(b, f"{scope}/layer.0/SelfAttention", normed, dim, heads, causal=True, **t5_attn)
        h = b.node(f"{scope}/layer.0", "Add", [h, a])
        normed = rms_norm(b, f"{scope}/layer.1/layer_norm", h, dim, 1e-6)
        a = attention(
            b, f"{scope}/layer.1/EncDecAttention", normed, dim, heads, causal=False, kv_source=memory, **t5_attn
        )
        h = b.node(f"{scope}/layer.1", "Add", [h, a])
        h = ff_layer(f"{scope}/layer.2", h, i)
    h = rms_norm(b, "decoder/final_layer_norm", h, dim, 1e-6)
    # tied output embedding, scaled by dim**-0.5 as T5 does when tying
    k = b.node("lm_head", "Constant", [], value=helper.make_tensor("value", b.dtype, [], [dim**-0.5]))
    w_t = b.node("lm_head", "Transpose", [shared], perm=[1, 0])
    logits = b.node("lm_head", "MatMul", [b.node("lm_head", "Mul", [h, k]), w_t])
    b.output(logits, "logits", ["batch", "dec_seq", vocab])
    return b.model({"batch": 1, "seq": 512, "dec_seq": 128}, build_switch_moe.__doc__)


# ---------------------------------------------------------------- CLIP and LLaVA


def vit_tower(b: GraphBuilder, prefix: str, pixels: str, image: int, layers: int, dim: int = 1024,
              heads: int = 16, ff: int = 4096, patch: int = 14) -> str:
    """CLIP vision transformer up to the encoder output ``[batch, 1 + patches, dim]``.

    Patch embedding (Conv, no bias), class token and position embedding, pre-LayerNorm,
    ``layers`` pre-norm encoder layers (quick-GELU MLP). The class token is
    prepended by padding the patch sequence with one zero row and adding
    ``onehot_row0 * class_embedding + position_embedding``: the same result as
    concatenating an expanded class token, with static shapes, and the class
    embedding is read as a broadcast (bias-like) operand.
    """
    grid = image // patch
    tokens = grid * grid + 1
    emb = f"{prefix}/embeddings"
    conv_w = b.weight(f"{emb}/patch_embedding", "weight", [dim, 3, patch, patch])
    x = b.node(f"{emb}/patch_embedding", "Conv", [pixels, conv_w], strides=[patch, patch], kernel_shape=[patch, patch])
    x = b.node(emb, "Reshape", [x, b.const(emb, [0, dim, -1])])
    x = b.node(emb, "Transpose", [x], perm=[0, 2, 1])  # [batch, patches, dim]
    x = b.node(emb, "Pad", [x, b.const(emb, [0, 1, 0, 0, 0, 0])])
    row0 = helper.make_tensor("value", b.dtype, [tokens, 1], [1.0] + [0.0] * (tokens - 1))
    cls = b.node(emb, "Mul", [b.node(emb, "Constant", [], value=row0), b.weight(emb, "class_embedding", [dim])])
    pos = b.node(emb, "Add", [cls, b.weight(f"{emb}/position_embedding", "weight", [tokens, dim])])
    x = b.node(emb, "Add", [x, pos])
    x = layer_norm(b, f"{prefix}/pre_layrnorm", x, dim)
    return clip_encoder(b, f"{prefix}/encoder", x, layers, dim, heads, ff, causal=False)


def clip_encoder(b: GraphBuilder, prefix: str, x: str, layers: int, dim: int, heads: int, ff: int, causal: bool) -> str:
    """Pre-norm transformer encoder layers of CLIP (both towers)."""
    for i in range(layers):
        scope = f"{prefix}/layers.{i}"
        a = attention(
            b, f"{scope}/self_attn", layer_norm(b, f"{scope}/layer_norm1", x, dim), dim, heads,
            causal=causal, bias=True, names=("q_proj", "k_proj", "v_proj", "out_proj"),
        )
        x = b.node(scope, "Add", [x, a])
        m = gelu_mlp(b, f"{scope}/mlp", layer_norm(b, f"{scope}/layer_norm2", x, dim), dim, ff)
        x = b.node(scope, "Add", [x, m])
    return x


def l2_normalize(b: GraphBuilder, scope: str, x: str) -> str:
    """``x / ||x||`` over the last axis."""
    norm = b.node(scope, "ReduceL2", [x, b.const(scope, [-1])], keepdims=1)
    return b.node(scope, "Div", [x, norm])


def build_clip_vit_l14() -> onnx.ModelProto:
    """CLIP ViT-L/14 (224 px): vision tower 24 layers d=1024, text tower 12 layers d=768 (context 77,
    vocab 49408), projections to 768, contrastive logits [batch, batch] (0.43 B)."""
    b = GraphBuilder("clip_vit_l14")
    pixels = b.data("pixel_values", ["batch", 3, 224, 224])
    ids = b.data("input_ids", ["batch", 77], I64)

    v = vit_tower(b, "vision_model", pixels, 224, 24)
    v = b.node("vision_model", "Gather", [v, b.node("vision_model", "Constant", [], value=helper.make_tensor("value", I64, [], [0]))], axis=1)
    v = layer_norm(b, "vision_model/post_layernorm", v, 1024)
    img = linear(b, "visual_projection", v, 1024, 768)

    t = embedding(b, "text_model/embeddings/token_embedding", ids, 49408, 768)
    t = b.node("text_model/embeddings", "Add", [t, b.weight("text_model/embeddings/position_embedding", "weight", [77, 768])])
    t = clip_encoder(b, "text_model/encoder", t, 12, 768, 12, 3072, causal=True)
    t = layer_norm(b, "text_model/final_layer_norm", t, 768)
    eot = b.node("text_model", "ArgMax", [ids], axis=1, keepdims=1)  # end-of-text has the largest id
    t = b.node("text_model", "GatherND", [t, eot], batch_dims=1)
    txt = linear(b, "text_projection", t, 768, 768)

    img = l2_normalize(b, "", img)
    txt = l2_normalize(b, "", txt)
    scale = b.node("", "Exp", [b.weight("", "logit_scale", [])])
    sim = b.node("", "MatMul", [img, b.node("", "Transpose", [txt], perm=[1, 0])])
    b.output(b.node("", "Mul", [sim, scale]), "logits_per_image", ["batch", "batch"])
    return b.model({"batch": 8}, build_clip_vit_l14.__doc__)


def build_llava_7b() -> onnx.ModelProto:
    """LLaVA-1.5-7B: CLIP ViT-L/14-336 vision encoder (features of layer 23 of 24, class token dropped,
    576 patches) -> 2-layer GELU MLP projector -> Llama-2-7B language model (vocab 32064) (7.05 B)."""
    b = GraphBuilder("llava_7b")
    pixels = b.data("pixel_values", ["batch", 3, 336, 336])
    ids = b.data("input_ids", ["batch", "seq"], I64)
    # (batch index, position) of each of the 576 image tokens in input_ids, as the processor lays them out
    where = b.data("image_positions", ["batch", 576, 2], I64)

    # LLaVA reads the penultimate layer: the 24th layer and post_layernorm never run, so are left out
    v = vit_tower(b, "model/vision_tower/vision_model", pixels, 336, 23)
    v = b.node("model/vision_tower", "Slice", [v, b.const("model/vision_tower", [1]), b.const("model/vision_tower", [577]), b.const("model/vision_tower", [1])])
    proj = "model/multi_modal_projector"
    v = linear(b, f"{proj}/linear_1", v, 1024, 4096, bias=True)
    v = linear(b, f"{proj}/linear_2", b.node(proj, "Gelu", [v]), 4096, 4096, bias=True)

    h = embedding(b, "model/language_model/embed_tokens", ids, 32064, 4096)
    h = b.node("model", "ScatterND", [h, where, v])  # image features replace the image-token embeddings
    logits = decoder_lm(
        b, "model/language_model", h, layers=32, dim=4096, heads=32, kv_heads=32, vocab=32064, mlp_fn=dense_mlp(4096, 11008)
    )
    b.output(logits, "logits", ["batch", "seq", 32064])
    return b.model({"batch": 1, "seq": 2048}, build_llava_7b.__doc__)


# ---------------------------------------------------------------- frontier models (written on demand)
#
# Sizes from the published Hugging Face configurations:
# - meta-llama/Llama-3.1-405B, config.json: hidden_size 16384, intermediate_size 53248,
#   num_hidden_layers 126, num_attention_heads 128, num_key_value_heads 8 (head_dim 128),
#   vocab_size 128256, tie_word_embeddings false, rms_norm_eps 1e-05; 405,853,388,800
#   parameters (Llama 3 paper, arXiv:2407.21783, Table 3: 405 B).
# - deepseek-ai/DeepSeek-V3, config.json: hidden_size 7168, num_hidden_layers 61,
#   first_k_dense_replace 3, intermediate_size 18432, moe_intermediate_size 2048,
#   n_shared_experts 1, n_routed_experts 256, num_experts_per_tok 8, norm_topk_prob true,
#   routed_scaling_factor 2.5, scoring_func sigmoid, num_attention_heads 128,
#   q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64,
#   v_head_dim 128, vocab_size 129280, tie_word_embeddings false, rms_norm_eps 1e-06,
#   num_nextn_predict_layers 1 (the MTP module, left out here). The technical report
#   (arXiv:2412.19437) gives 671 B main-model parameters plus 14 B for MTP; the config
#   gives 671,026,419,200 without MTP.


def build_llama3_405b() -> onnx.ModelProto:
    """Llama-3.1-405B: 126 layers, d=16384, GQA 128/8 heads of 128, SwiGLU FFN 53248, vocab 128256,
    untied embeddings (405.9 B)."""
    return _llama3("llama3_405b", build_llama3_405b.__doc__, layers=126, dim=16384, heads=128, ffn=53248)


def build_deepseek_v3() -> onnx.ModelProto:
    """DeepSeek-V3 without its MTP module: 61 layers, d=7168, multi-head latent attention (128 heads,
    q rank 1536, kv rank 512, key 128+64, value 128); layers 0-2 dense (FFN 18432); layers 3-60:
    1 shared + 256 routed SwiGLU experts (2048) top-8, sigmoid router; vocab 129280 (671.0 B)."""
    return _deepseek_v3("deepseek_v3", build_deepseek_v3.__doc__, mtp=False)


def _deepseek_v3(name: str, doc: str, mtp: bool) -> onnx.ModelProto:
    """DeepSeek-V3's main model, and with ``mtp`` its multi-token-prediction module after it."""
    b = GraphBuilder(name)
    dim, vocab, eps = 7168, 129280, 1e-6
    ids = b.data("input_ids", ["batch", "seq"], I64)
    h = embedding(b, "model/embed_tokens", ids, vocab, dim)
    dense = dense_mlp(dim, 18432)
    router = sigmoid_top_k(2.5)

    def attn(b, scope, x):
        return mla_attention(b, scope, x, dim, 128, q_rank=1536, kv_rank=512, nope_dim=128, rope_dim=64,
                             v_dim=128, eps=eps)

    def expert(b, scope, t):
        return swiglu_mlp(b, scope, t, dim, 2048)

    def mlp(b, scope, x, residual, layer):
        if layer < 3:
            return dense(b, scope, x, residual, layer)
        shared = swiglu_mlp(b, f"{scope}/shared_experts", x, dim, 2048)
        base = b.node(scope.rsplit("/", 1)[0], "Add", [residual, shared])
        return moe_layer(b, scope, x, base, dim, 256, 8, expert, normalize_top_k=True, router=router)

    hidden: list[str] = []
    logits = decoder_lm(b, "model", h, layers=61, dim=dim, heads=128, kv_heads=128, vocab=vocab, mlp_fn=mlp,
                        eps=eps, attn_fn=attn, hidden_out=hidden)
    if not mtp:
        b.output(logits, "logits", ["batch", "seq", vocab])
        return b.model({"batch": 1, "seq": 4096}, doc)
    b.outputs.append(helper.make_tensor_value_info(logits, b.dtype, ["batch", "seq", vocab]))
    layer = functools.partial(decoder_layer, dim=dim, heads=128, kv_heads=128, mlp_fn=mlp, eps=eps, attn_fn=attn)
    mtp_logits = mtp_module(b, "model/mtp", hidden[0], ids, dim=dim, vocab=vocab, eps=eps, layer=layer, index=61)
    b.output(mtp_logits, "mtp_logits", ["batch", "seq", vocab])
    return b.model({"batch": 1, "seq": 4096}, doc)


def mtp_module(b: GraphBuilder, scope: str, hidden: str, ids: str, *, dim: int, vocab: int, eps: float, layer,
               index: int) -> str:
    """DeepSeek-V3's multi-token-prediction module (arXiv:2412.19437 §2.2): the main model's last hidden state
    and the embedding of the next tokens, each RMS-normed, concatenated and projected back to ``dim``
    (``eh_proj``), one decoder layer (``layer(b, scope, h, index)``, numbered as the main model's next), a
    final norm and the output head. The embedding and the head are the checkpoint's own copies
    (``model.layers.61.embed_tokens``, ``shared_head.head``; shared with the main model in training, held again
    on the pipeline rank that runs the module). Scopes ``{scope}/layers.0/...``: Megatron-Core's ``mtp.layers.0``.
    """
    inner = f"{scope}/layers.0"
    emb = embedding(b, f"{inner}/embed_tokens", ids, vocab, dim)
    joined = b.node(inner, "Concat", [rms_norm(b, f"{inner}/hnorm", hidden, dim, eps),
                                      rms_norm(b, f"{inner}/enorm", emb, dim, eps)], axis=-1)
    h = linear(b, f"{inner}/eh_proj", joined, 2 * dim, dim)
    h = layer(b, f"{inner}/transformer_layer", h, index)
    h = rms_norm(b, f"{inner}/shared_head/norm", h, dim, eps)
    return linear(b, f"{inner}/shared_head/head", h, dim, vocab)


def build_deepseek_v3_mtp() -> onnx.ModelProto:
    """DeepSeek-V3 as trained: the 61-layer main model of :func:`build_deepseek_v3` (671.0 B) and one MTP
    module (13.5 B with its own embedding and head copies, the checkpoint's layer 61: the report's "14 B")."""
    return _deepseek_v3("deepseek_v3_mtp", build_deepseek_v3_mtp.__doc__, mtp=True)


# ---------------------------------------------------------------- published MoE rows (issue 43; on demand)
#
# - mistral-community/Mixtral-8x22B-v0.1, config.json: hidden_size 6144, intermediate_size 16384,
#   num_hidden_layers 56, num_attention_heads 48, num_key_value_heads 8, num_local_experts 8,
#   num_experts_per_tok 2, vocab_size 32000, tie_word_embeddings false: 140,620,627,968 parameters
#   (Mistral AI: "141B parameters").
# - Qwen/Qwen3-30B-A3B, config.json: hidden_size 2048, num_hidden_layers 48, num_attention_heads 32,
#   num_key_value_heads 4, head_dim 128, q/k RMSNorm per head, num_experts 128, num_experts_per_tok 8,
#   moe_intermediate_size 768, norm_topk_prob true, every layer MoE, vocab_size 151936,
#   tie_word_embeddings false: 30,532,134,912 parameters (model card: 30.5B total, 3.3B activated).


def build_mixtral_8x22b() -> onnx.ModelProto:
    """Mixtral-8x22B: 56 layers, d=6144, GQA 48/8 heads, 8 SwiGLU experts (FFN 16384) top-2, vocab 32000 (140.6 B)."""
    b = GraphBuilder("mixtral_8x22b")
    ids = b.data("input_ids", ["batch", "seq"], I64)
    h = embedding(b, "model/embed_tokens", ids, 32000, 6144)

    def expert(b, scope, t):
        return swiglu_mlp(b, scope, t, 6144, 16384, names=("w1", "w3", "w2"))

    def mlp(b, scope, x, residual, layer):
        return moe_layer(b, scope, x, residual, 6144, 8, 2, expert, normalize_top_k=True)

    logits = decoder_lm(b, "model", h, layers=56, dim=6144, heads=48, kv_heads=8, vocab=32000, mlp_fn=mlp,
                        mlp_name="block_sparse_moe")
    b.output(logits, "logits", ["batch", "seq", 32000])
    return b.model({"batch": 1, "seq": 4096}, build_mixtral_8x22b.__doc__)


def qk_norm_attention(b: GraphBuilder, scope: str, x: str, dim: int, heads: int, kv_heads: int, head_dim: int,
                      eps: float) -> str:
    """Grouped-query attention with RMSNorm on each head's queries and keys (Qwen3's ``q_norm`` / ``k_norm``)."""
    def per_head_norm(name: str, t: str, n: int) -> str:
        split = b.node(scope, "Reshape", [t, b.const(scope, [0, 0, n, head_dim])])
        normed = rms_norm(b, f"{scope}/{name}", split, head_dim, eps)
        return b.node(scope, "Reshape", [normed, b.const(scope, [0, 0, n * head_dim])])

    q = per_head_norm("q_norm", linear(b, f"{scope}/q_proj", x, dim, heads * head_dim), heads)
    k = per_head_norm("k_norm", linear(b, f"{scope}/k_proj", x, dim, kv_heads * head_dim), kv_heads)
    v = linear(b, f"{scope}/v_proj", x, dim, kv_heads * head_dim)
    a = b.node(scope, "Attention", [q, k, v], q_num_heads=heads, kv_num_heads=kv_heads, is_causal=1)
    return linear(b, f"{scope}/o_proj", a, heads * head_dim, dim)


def build_qwen3_30b_a3b() -> onnx.ModelProto:
    """Qwen3-30B-A3B: 48 layers, d=2048, GQA 32/4 heads of 128 with q/k norms, every layer 128 SwiGLU experts
    (768) top-8, no shared expert, vocab 151936 (30.5 B, 3.3 B active)."""
    b = GraphBuilder("qwen3_30b_a3b")
    dim, vocab, eps = 2048, 151936, 1e-6
    ids = b.data("input_ids", ["batch", "seq"], I64)
    h = embedding(b, "model/embed_tokens", ids, vocab, dim)

    def attn(b, scope, x):
        return qk_norm_attention(b, scope, x, dim, 32, 4, 128, eps)

    def expert(b, scope, t):
        return swiglu_mlp(b, scope, t, dim, 768)

    def mlp(b, scope, x, residual, layer):
        return moe_layer(b, scope, x, residual, dim, 128, 8, expert, normalize_top_k=True)

    logits = decoder_lm(b, "model", h, layers=48, dim=dim, heads=32, kv_heads=4, vocab=vocab, mlp_fn=mlp, eps=eps,
                        attn_fn=attn)
    b.output(logits, "logits", ["batch", "seq", vocab])
    return b.model({"batch": 1, "seq": 4096}, build_qwen3_30b_a3b.__doc__)



# ---------------------------------------------------------------- branchy models of the literature (on demand)
#
# GraphPipe (Jeon et al., ASPLOS'25, arXiv 2406.17145), appendix A.2: the multi-modal transformer (MMT) is
# 4 branches of 8 transformer layers each (hidden 1024, FFN 4096, 16 heads, sequence 256) whose outputs are
# concatenated. What each branch reads and what follows the concatenation are not given there: here each
# branch reads its own modality as features [batch, 256, 1024] (already embedded), the branches' outputs are
# concatenated along the hidden axis and one linear layer maps K x 1024 back to 1024 (an assumption; it is
# 0.4 % of the parameters). Layers are pre-LayerNorm with biases and a GELU MLP (as CLIP's encoder layers).
# The same builder with K branches is the synthetic family of GraphPipe's branch-count study (its Fig. 7).
#
# CANDLE-Uno (ECP-CANDLE/Benchmarks, Pilot1/Uno, uno_default_model.txt and uno_baseline_keras2.py): one
# feature encoder per input feature (dense_feature_layers = [1000, 1000, 1000], ReLU), the encoders' outputs
# and the doses concatenated, then dense = [1000, 1000, 1000] and one output. Inputs as in Uno's
# ALMANAC drug-pair runs: cell.rnaseq (942 landmark genes), drug1/drug2 descriptors (5,270 Dragon7
# descriptors) and fingerprints (2,048 bits), dose1 and dose2; a feature type's encoder is shared by both
# drugs in Uno (Keras reuses the submodel), so here too (one weight, two branches that use it).
# GraphPipe's appendix scales Uno up for its runs; those sizes could not be read here (the appendix was not
# reachable from this machine), so this is Uno's published default, with ``width`` and ``depth`` to scale it.
#
# Optimus (Feng et al., ATC'25, arXiv 2408.03505), appendix A, sequence 2048: ViT-3B (hidden 2304, 48 layers,
# MLP 9216, 18 heads), ViT-5B (3072, 48, 12288, 24), ViT-22B (6144, 48, 24576, 48), GPT-11B (3072, 80
# layers, 24 heads), GPT-175B (12288, 96, 96 heads). Not published: image tokens per sample; here 256, a
# 224 px image in patches of 14 (16 x 16), each encoder's 256 tokens projected by one linear layer to the
# LLM's width and written over image-token embeddings of the 2048-token sequence (as LLaVA does). The
# ViTs are CLIP-style pre-norm encoders without a class token; the GPTs are Megatron-LM GPTs (vocab 51200,
# learned positions, FFN 4 h). The layer sizes give GPT-11B 9.2 B parameters, not 11 B: the paper's name is
# kept, the count is the architecture's.

MMT_LAYER_SIZES = {"layers": 8, "dim": 1024, "heads": 16, "ff": 4096, "seq": 256}


def branchy_transformer(name: str, branches: int, doc: str, sizes: dict | None = None) -> onnx.ModelProto:
    """``branches`` equal transformer towers (GraphPipe's MMT sizes, or ``sizes``: a tiny MMT that
    ``opsched run --mmt-config`` runs) on their own inputs, concatenated, one linear."""
    sizes = {**MMT_LAYER_SIZES, **(sizes or {})}
    layers, dim, heads, ff, seq = (sizes[k] for k in ("layers", "dim", "heads", "ff", "seq"))
    b = GraphBuilder(name, dtype=F16)  # V100s have no bfloat16: GraphPipe's runs are fp16 mixed precision
    outs = []
    for k in range(branches):
        x = b.data(f"modality_{k}", ["batch", "seq", dim])
        tower = f"branches.{k}"
        h = transformer_layers(b, f"{tower}/layers", x, layers, dim, heads, ff)
        outs.append(layer_norm(b, f"{tower}/final_layernorm", h, dim))
    joined = b.node("fusion", "Concat", outs, axis=-1)
    y = linear(b, "fusion/proj", joined, branches * dim, dim, bias=True)
    b.output(y, "fused", ["batch", "seq", dim])
    return b.model({"batch": 1, "seq": seq}, doc)


def transformer_layers(b: GraphBuilder, prefix: str, x: str, layers: int, dim: int, heads: int, ff: int,
                       causal: bool = False) -> str:
    """Pre-LayerNorm encoder layers with biases and a (tanh-free) GELU MLP: ``prefix/<i>/...``."""
    for i in range(layers):
        scope = f"{prefix}.{i}"
        a = attention(b, f"{scope}/self_attn", layer_norm(b, f"{scope}/norm1", x, dim), dim, heads, causal=causal,
                      bias=True, names=("q_proj", "k_proj", "v_proj", "out_proj"))
        x = b.node(scope, "Add", [x, a])
        x = b.node(scope, "Add", [x, gelu_mlp(b, f"{scope}/mlp", layer_norm(b, f"{scope}/norm2", x, dim), dim, ff,
                                              quick=False)])
    return x


def build_mmt() -> onnx.ModelProto:
    """GraphPipe's multi-modal transformer: 4 branches x 8 layers (d=1024, FFN 4096, 16 heads, sequence 256),
    concatenated, one linear layer 4096 -> 1024 (0.41 B)."""
    return branchy_transformer("mmt", 4, build_mmt.__doc__)


def build_branches(k: int) -> onnx.ModelProto:
    """The synthetic family: MMT with ``k`` equal branches of 8 layers."""
    return branchy_transformer(f"branches_k{k}", k, f"MMT's layers in {k} equal branches of 8, concatenated.")


UNO_FEATURES = {"cell_rnaseq": 942, "drug_descriptors": 5270, "drug_fingerprints": 2048}


def build_candle_uno(width: int = 1000, depth: int = 3) -> onnx.ModelProto:
    """CANDLE-Uno (drug-pair response): feature encoders of ``depth`` ReLU dense layers of ``width`` for cell
    RNA-seq and each drug's descriptors and fingerprints (one encoder per feature type, shared by both
    drugs), concatenated with the two doses, ``depth`` dense layers, one output (21.3 M at the default)."""
    b = GraphBuilder("candle_uno", dtype=F32)  # Uno trains in float32 (Keras defaults)

    def encoder(feature: str, x: str) -> str:
        d_in = UNO_FEATURES[feature]
        for i in range(depth):
            x = b.node(f"{feature}_net/dense_{i}", "Relu", [linear(b, f"{feature}_net/dense_{i}", x, d_in, width,
                                                                     bias=True)])
            d_in = width
        return x

    encoded: set[str] = set()  # feature types whose encoder exists: a second use reads its weights
    parts = []
    for source, feature in (("cell", "cell_rnaseq"), ("drug1", "drug_descriptors"), ("drug1", "drug_fingerprints"),
                            ("drug2", "drug_descriptors"), ("drug2", "drug_fingerprints")):
        x = b.data(f"{source}.{feature.split('_')[1]}", ["batch", UNO_FEATURES[feature]])
        parts.append(shared_encoder(b, encoded, feature, x, encoder))
    parts += [b.data("dose1", ["batch", 1]), b.data("dose2", ["batch", 1])]
    h = b.node("", "Concat", parts, axis=-1)
    d_in = 5 * width + 2
    for i in range(depth):
        h = b.node(f"dense_{i}", "Relu", [linear(b, f"dense_{i}", h, d_in, width, bias=True)])
        d_in = width
    y = linear(b, "output", h, width, 1, bias=True)
    b.output(y, "growth", ["batch", 1], F32)
    return b.model({"batch": 32}, build_candle_uno.__doc__)


def shared_encoder(b: GraphBuilder, seen: set[str], feature: str, x: str, make) -> str:
    """Run ``make(feature, x)``; the second time a feature is encoded, its nodes read the first use's weights.

    Weight names come from the scope, so the second use declares the same names again: those declarations
    (and the parameters they added) are dropped, and its nodes are renamed into ``<feature>_net_1``.
    """
    if feature not in seen:
        seen.add(feature)
        return make(feature, x)
    start, inputs, params = len(b.nodes), len(b.inputs), b.param_count
    out = make(feature, x)
    del b.inputs[inputs:]
    b.param_count = params
    for n in b.nodes[start:]:
        n.name = n.name.replace(f"/{feature}_net/", f"/{feature}_net_1/")
    return out


# Optimus appendix A: (hidden, layers, MLP, heads) of the ViTs; (hidden, layers, heads) of the GPTs.
OPTIMUS_VIT = {"vit_3b": (2304, 48, 9216, 18), "vit_5b": (3072, 48, 12288, 24), "vit_22b": (6144, 48, 24576, 48)}
OPTIMUS_GPT = {"gpt_11b": (3072, 80, 24), "gpt_175b": (12288, 96, 96)}
OPTIMUS_IMAGE_TOKENS = 256  # not published: a 224 px image in patches of 14


def optimus_mllm(name: str, encoders: tuple[str, ...], llm: str) -> onnx.ModelProto:
    """An Optimus multimodal LLM: the ``encoders`` (ViTs, each on its own image) feed the ``llm`` (a GPT)."""
    dim, layers, heads = OPTIMUS_GPT[llm]
    b = GraphBuilder(name)
    ids = b.data("input_ids", ["batch", "seq"], I64)
    positions = b.data("position_ids", ["batch", "seq"], I64)
    emb = "language_model/embedding"
    words = b.weight(f"{emb}/word_embeddings", "weight", [51200, dim])
    h = b.node(f"{emb}/word_embeddings", "Gather", [words, ids], axis=0)
    h = b.node(emb, "Add", [h, embedding(b, f"{emb}/position_embeddings", positions, 2048, dim)])
    for k, enc in enumerate(encoders):
        pixels = b.data(f"pixel_values_{k}", ["batch", 3, 224, 224])
        where = b.data(f"image_positions_{k}", ["batch", OPTIMUS_IMAGE_TOKENS, 2], I64)
        v = optimus_vit(b, f"encoder_{k}", pixels, *OPTIMUS_VIT[enc])
        v = linear(b, f"encoder_{k}/projector", v, OPTIMUS_VIT[enc][0], dim, bias=True)
        h = b.node(f"encoder_{k}", "ScatterND", [h, where, v])  # image features replace image-token embeddings
    for i in range(layers):
        h = megatron_layer(b, f"language_model/encoder/layers.{i}", h, dim, heads)
    h = layer_norm(b, "language_model/encoder/final_layernorm", h, dim)
    logits = b.node("lm_head", "MatMul", [h, b.node("lm_head", "Transpose", [words], perm=[1, 0])])
    b.output(logits, "logits", ["batch", "seq", 51200])
    doc = f"Optimus's {' + '.join(e.upper().replace('_', '-') for e in encoders + (llm,))} (appendix A; sequence 2048)."
    return b.model({"batch": 1, "seq": 2048}, doc)


def optimus_vit(b: GraphBuilder, prefix: str, pixels: str, dim: int, layers: int, ff: int, heads: int) -> str:
    """A ViT of 256 patch tokens (patch 14 over 224 px, learned positions, no class token), pre-norm layers."""
    conv_w = b.weight(f"{prefix}/patch_embed", "weight", [dim, 3, 14, 14])
    x = b.node(f"{prefix}/patch_embed", "Conv", [pixels, conv_w], strides=[14, 14], kernel_shape=[14, 14])
    x = b.node(prefix, "Transpose", [b.node(prefix, "Reshape", [x, b.const(prefix, [0, dim, -1])])], perm=[0, 2, 1])
    x = b.node(prefix, "Add", [x, b.weight(f"{prefix}/pos_embed", "weight", [OPTIMUS_IMAGE_TOKENS, dim])])
    x = transformer_layers(b, f"{prefix}/layers", x, layers, dim, heads, ff)
    return layer_norm(b, f"{prefix}/final_layernorm", x, dim)


def megatron_layer(b: GraphBuilder, scope: str, h: str, dim: int, heads: int) -> str:
    """One Megatron-LM GPT layer (see the note above :func:`megatron_gpt`) on the residual stream ``h``."""
    attn = f"{scope}/self_attention"
    x = layer_norm(b, f"{scope}/input_layernorm", h, dim)
    qkv = linear(b, f"{attn}/query_key_value", x, dim, 3 * dim, bias=True)
    q, k, v = b.node(attn, "Split", [qkv, b.const(attn, [dim] * 3)], n_outputs=3, axis=-1)
    a = b.node(attn, "Attention", [q, k, v], q_num_heads=heads, kv_num_heads=heads, is_causal=1)
    h = b.node(scope, "Add", [h, linear(b, f"{attn}/dense", a, dim, dim, bias=True)])
    x = layer_norm(b, f"{scope}/post_attention_layernorm", h, dim)
    up = linear(b, f"{scope}/mlp/dense_h_to_4h", x, dim, 4 * dim, bias=True)
    up = b.node(f"{scope}/mlp", "Gelu", [up], approximate="tanh")
    return b.node(scope, "Add", [h, linear(b, f"{scope}/mlp/dense_4h_to_h", up, 4 * dim, dim, bias=True)])


OPTIMUS_MODELS = {
    "optimus_vit3b_gpt11b": (("vit_3b",), "gpt_11b"),  # Table 4
    "optimus_vit22b_gpt175b": (("vit_22b",), "gpt_175b"),  # Table 5
    "optimus_vit22b_vit5b_gpt175b": (("vit_22b", "vit_5b"), "gpt_175b"),  # Table 6, two encoders
}
BRANCH_COUNTS = (2, 4, 8, 16)


MODELS = {
    "mixtral_8x7b": build_mixtral_8x7b,
    "deepseek_moe": build_deepseek_moe,
    "switch_moe": build_switch_moe,
    "clip_vit_l14": build_clip_vit_l14,
    "llava_7b": build_llava_7b,
    "llama_7b": build_llama_7b,
    "mpt_7b": build_mpt_7b,
    "gpt_1_7b": build_gpt_1_7b,
    "gpt_3_6b": build_gpt_3_6b,
    "gpt_7_5b": build_gpt_7_5b,
    "gpt_18_4b": build_gpt_18_4b,
    "llama3_8b": build_llama3_8b,
    "llama3_405b": build_llama3_405b,
    "deepseek_v3": build_deepseek_v3,
    "gpt_39_1b": build_gpt_39_1b,
    "gpt_76_1b": build_gpt_76_1b,
    "gpt_145_6b": build_gpt_145_6b,
    "gpt_310_1b": build_gpt_310_1b,
    "gpt_529_6b": build_gpt_529_6b,
    "gpt_1008b": build_gpt_1008b,
    **{name: functools.partial(mcore_r08_gpt, name) for name in MCORE_R08_GPT},
    "bloom_176b": build_bloom_176b,
    "mpt_13b": build_mpt_13b,
    "mpt_30b": build_mpt_30b,
    "deepseek_v3_mtp": build_deepseek_v3_mtp,
    "mixtral_8x22b": build_mixtral_8x22b,
    "qwen3_30b_a3b": build_qwen3_30b_a3b,
    "mmt": build_mmt,
    "candle_uno": build_candle_uno,
    **{f"branches_k{k}": functools.partial(build_branches, k) for k in BRANCH_COUNTS},
    **{name: functools.partial(optimus_mllm, name, *parts) for name, parts in OPTIMUS_MODELS.items()},
}

# Written on demand only (``python models/build.py deepseek_v3``), never shipped:
# DeepSeek-V3's 14,848 expert branches make a 19 MB file that takes seconds to build; the
# published-run GPTs of 300 KB and more, and llm-foundry's MPT-13B and MPT-30B (benchmarks/bench_published.py
# writes them when it needs them).
ON_DEMAND = ("deepseek_v3", "gpt_310_1b", "gpt_529_6b", "gpt_1008b", "mcore_gpt_177b", "mcore_gpt_314b",
             "mcore_gpt_462b", "mpt_13b", "mpt_30b", "deepseek_v3_mtp",
             "mixtral_8x22b", "qwen3_30b_a3b",
             # issue 44's branchy models of the literature: generated where a benchmark or a user needs them
             "mmt", "candle_uno", *(f"branches_k{k}" for k in BRANCH_COUNTS), *OPTIMUS_MODELS)
BUNDLED = tuple(name for name in MODELS if name not in ON_DEMAND)


def write_model(model: onnx.ModelProto, path: str) -> None:
    """Serialise deterministically and write atomically (temp file, then rename)."""
    data = model.SerializeToString(deterministic=True)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".onnx")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the bundled shape-only ONNX models.")
    parser.add_argument("names", nargs="*", help=f"models to build (default: the bundled {', '.join(BUNDLED)}; "
                        f"on demand: {', '.join(ON_DEMAND)})")
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)), help="output folder")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    os.makedirs(args.out, exist_ok=True)
    for name in args.names or BUNDLED:
        model = MODELS[name]()
        path = os.path.join(args.out, f"{name}.onnx")
        write_model(model, path)
        params = {p.key: p.value for p in model.metadata_props}["opsched.param_count"]
        print(f"{path}: {len(model.graph.node)} nodes, {int(params):,} parameters, "
              f"{os.path.getsize(path) / 1024:.0f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
