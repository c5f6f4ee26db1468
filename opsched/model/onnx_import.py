"""ONNX model -> OpGraph, with a forward cost for every operator.

>>> g = import_onnx("models/mixtral_8x7b.onnx", dims={"batch": 1, "seq": 4096})  # doctest: +SKIP
>>> from opsched.model.graph import totals
>>> totals(g)["param_count"]                                                     # doctest: +SKIP

What the importer does, in order:

1. **Load without weights**: ``onnx.load(path, load_external_data=False)``. Only
   tensor *shapes* are read; the one exception is tiny integer constants (the
   ``K`` of a TopK), read to size MoE routing.
2. **Dimensions**: symbolic dims of the graph inputs take their values from
   ``dims``; a model may carry defaults in its metadata key
   ``opsched.default_dims`` (``"batch=1,seq=4096"``), which ``dims`` overrides.
   A dim left without a value is an :class:`OpschedError` naming it and the
   flag ``--dim NAME=VALUE``. Symbolic expressions the exporter wrote into
   ``value_info`` (``"2*s0"``) are evaluated with those values.
   A model exported with a **static batch** (most exports without dynamic
   axes) has one found for it: when every data input (``opsched.data_inputs``,
   else every graph input that is no initializer) has rank 2 or more and the
   same fixed leading size B0, that axis is the batch ``batch`` (default B0,
   set like a symbolic one); at batch b every tensor a data input reaches, and
   every operator writing one, costs b / B0 times its shape's bytes and FLOPs
   (:func:`opsched.model.onnx_dims.static_batch`; a warning says so when b differs from B0).
3. **Shape inference** (``onnx.shape_inference``, with data propagation).
4. **MoE routing assumption**: an expert loop exported with ``NonZero`` has
   data-dependent token counts. Each ``NonZero`` output is pinned to
   ``[rank, n]`` with **balanced routing**::

       n = ceil(capacity_factor * tokens * top_k / num_experts)

   where ``num_experts`` (the routed axis) and ``tokens`` (the other elements)
   come from the input of the nearest upstream ``TopK`` (the router) and
   ``top_k`` is its ``K``. Shape inference then runs again so the expert
   branches get static shapes. A ``NonZero`` with no router upstream is a
   mask, not routing (LLaVA merges its image features into the text that
   way): it is assumed all-nonzero, the most it can cost, and a warning says so. Capacity-style routing
   (``TopK`` over tokens) is static already and needs no assumption.
5. **Costs** per node (forward, one microbatch; a multiply-add is 2 FLOPs):

   ======================================  =========================================
   MatMul, Gemm                            2*M*N*K (+ M*N when Gemm has a bias C)
   Conv / ConvTranspose                    2 * out * (C_in/group) * kernel (+ out for a bias)
   Einsum                                  n_operands * product of all index sizes (1 operand: input size)
   Attention (opset 23)                    2*B*H*Sq*Skv*(Dqk + Dv) + 6*B*H*Sq*Skv (scale + softmax)
   LayerNormalization                      8 per element (7 without bias)
   RMSNormalization / SimplifiedLayerNorm  4 per element
   Batch/Instance/GroupNormalization       8 per element
   Softmax, LogSoftmax                     5 per element
   elementwise (Add, Mul, Relu, Sigmoid,   1 per output element
   Erf, Where, Equal, ...)
   reductions (ReduceSum, ReduceMean, ...)  1 per input element (2 for L2, SumSquare, LogSumExp)
   pooling                                 output elements * kernel size
   TopK, ArgMax, CumSum                    1 per input element
   Gather/Scatter/Reshape/Transpose/...    0 FLOPs: bytes only
   unknown op types                        0 FLOPs: bytes only, listed in a warning
   ======================================  =========================================

   ``output_bytes`` is the size of the tensors a node writes, ``io_bytes`` the
   tensors it reads plus writes. An edge ``u -> v`` carries the bytes of the
   tensors v reads from u (0 when v only reads their shape: ``Shape``, ``Size``).

   Each op's FLOPs and bytes are also filed by kind: ``matmul_*`` for matrix
   multiplies and convolutions (``MATMUL_OPS``), ``attention_*`` for a fused
   ``Attention`` op; the cost model gives each kind its own efficiency.

   ``tp_comm_bytes`` marks where Megatron's tensor parallelism all-reduces:
   a weight matmul (MatMul / Gemm reading a parameter) whose output reaches
   an ``Add`` of two activations (the residual stream), through at most a
   bias ``Add`` and shape-only ops, is a row-parallel linear layer (attention's
   output projection, the MLP's down projection), and so is an embedding
   lookup (a Gather from a weight, split over the vocabulary); its output
   bytes are what the all-reduce moves (Shoeybi et al. 2019, section 3: two all-reduces of
   b x s x h per layer in the forward, two in the backward).

6. **Parameters**. Candidate weight tensors are floating-point initializers
   (with or without their external data present: the shape is in the
   TensorProto) and graph inputs that are weights. Which graph inputs are
   weights: when the model's metadata has ``opsched.data_inputs``
   (``"input_ids,pixel_values"``) every other graph input is a weight;
   otherwise a graph input is a weight when it has a fully static
   floating-point shape and every read of it (directly or through Identity,
   Transpose, Cast, Reshape, Squeeze, Unsqueeze, Flatten) is as the weight operand of
   MatMul/Gemm/Einsum (not the first operand), Conv, a normalisation (scale,
   bias), Gather (the table), or as the lower-rank operand of an elementwise
   op (a bias). A weight tensor is a parameter of the node that reads it in a
   weight position (those ops, elementwise ops included, any operand);
   tensors of fewer than 2 elements count as constants. A small weight (at
   most 1024 elements) read by several nodes counts once per reader, a bigger
   one once (owned by its first reader): torch's exporters deduplicate small
   equal-valued tensors (every LayerNorm weight starts as ones; dynamo shares
   one initializer, legacy adds Identity copies), while a big tensor read
   twice (directly or through an alias op such as Transpose) is a tied weight
   (shared embeddings). ``GatherND`` reads its table (input 0) in a weight
   position like ``Gather``.
7. **Stacked experts** (:mod:`opsched.model.stacked_experts`): when a router (a
   ``TopK`` over an axis of E that keeps fewer than E) is present, a weight of
   shape ``[E, ...]`` read by ``Gather`` / ``GatherND`` of expert indices or
   by a matmul batched over the expert axis makes the operators of that
   layer's expert computation split into E per-expert copies (scope
   ``.../experts.e``), each with 1/E of the weight and, for the gather style,
   ``ceil(capacity_factor * rows / E)`` of the S = tokens x top_k rows; the
   gathered copy of the weights (one matrix per row) is no activation, each
   expert matmul reads its weight in place. Graph
   attribute ``stacked_experts`` lists them (region scope -> experts, rows,
   rows per expert).

Module scope per node: dynamo's ``metadata_props["pkg.torch.onnx.name_scopes"]``
(full or relative module names; the leaf op name is dropped) or legacy names
``/model/layers.3/mlp/experts.1/w1/MatMul`` (the last component, the op, is
dropped). Scopes are tuples of module names: ``("model", "layers.3", "mlp",
"experts.1", "w1")``.

Graph attributes of the result: ``name``, ``kind="OpGraph"``, ``dims`` (the
resolved dims), ``warnings`` (list of str), ``exporter`` ("dynamo", "legacy"
or "helper"), ``capacity_factor``, ``data_inputs``, ``tensor_bytes`` (tensor
name -> bytes, for every tensor on an edge), ``moe_routing`` (NonZero node
below a router -> its balanced-routing count), ``nonzero_masks`` (any other
NonZero node -> its element count, assumed all nonzero). Node attribute ``const`` is True for nodes computed from
constants and weights only (no data input reaches them).
"""

from __future__ import annotations

import ast
import graphlib
import math
import os
import re
from collections import deque

import networkx as nx
import onnx
from onnx import TensorProto, numpy_helper

from opsched.errors import OpschedError
from opsched.model.graph import gc_paused
from opsched.model.onnx_dims import (
    BATCH, DATA_INPUTS_KEY, find_static_batch, model_metadata, resolve_dims, substitute_dims, symbolic_dim_names,
)
from opsched.model.onnx_build import _build_graph, _node_keys, _weight_inputs, mark_grouped_kv_heads
from opsched.model.onnx_ops import _FLOAT_TYPES, NAME_SCOPES_KEY, _attr, _numel, _static
from opsched.model.stacked_experts import find_families, router_sizes, split_families, stacked_weights
from opsched.model.recompute_modules import mark_activation_checkpoints, mark_moe_layers
from opsched.units import plural



# --------------------------------------------------------------------------- loading


def load_model(path) -> onnx.ModelProto:
    """Read an ONNX file's protobuf without its external weight data.

    Raises :class:`OpschedError` for a missing file, a file that is not ONNX,
    a truncated protobuf, or a model without nodes.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise OpschedError(f"model file not found: {path} (check the path)")
    if os.path.isdir(path):
        raise OpschedError(f"{path} is a directory, not an ONNX file")
    try:
        model = onnx.load(path, load_external_data=False)
    except OSError as exc:
        raise OpschedError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # protobuf DecodeError and friends: not a model
        raise OpschedError(
            f"{path} is not a readable ONNX model ({type(exc).__name__}: file truncated or not ONNX)"
        ) from None
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise OpschedError(f"{path} is not an ONNX model (no graph or IR version); export it with torch.onnx.export")
    if len(model.graph.node) == 0:
        raise OpschedError(f"{path}: the ONNX graph is empty (no nodes); nothing to plan")
    return model


# --------------------------------------------------------------------------- dims and shapes
def _infer(model: onnx.ModelProto, data_prop: bool = True) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=data_prop)
    except Exception as exc:  # inference errors on malformed graphs: report, keep going without it
        raise OpschedError(f"ONNX shape inference failed: {str(exc).splitlines()[0][:200]}") from None


def _infer_after_pins(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """Shape inference again once NonZero outputs are pinned, and the model's shape table (:func:`_shape_table`):
    without data propagation when that leaves no shape unknown, else with it.

    ONNX's data propagation walks every 1-D tensor's values, and each routed-token list is one: with 64 sequences of
    4,096 tokens per microbatch, DeepSeek-MoE's 1,728 expert selections took it 16 s, against 0.14 s without it
    (the same shapes, every one static)."""
    fast = _infer(model, data_prop=False)
    shapes = _shape_table(fast)
    if all(shape is not None and None not in shape for shape, _ in shapes.values()):
        return fast, shapes
    slow = _infer(model)
    return slow, _shape_table(slow)


def _shape_table(model: onnx.ModelProto) -> dict[str, tuple[tuple[int | None, ...] | None, int]]:
    """Tensor name -> (shape with None for unknown dims, or None if rank unknown; elem_type)."""
    table: dict[str, tuple] = {}
    g = model.graph
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        if not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        if tt.HasField("shape"):
            # an unset dim_value (a dim_param, or nothing) reads as 0
            shape = tuple(v if (v := d.dim_value) > 0 else None for d in tt.shape.dim)
        else:
            shape = None
        old = table.get(vi.name)
        if old is None or (old[0] is None or None in old[0]):
            table[vi.name] = (shape, tt.elem_type)
    for t in g.initializer:
        table[t.name] = (tuple(int(x) for x in t.dims), t.data_type)
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    table[n.output[0]] = (tuple(int(x) for x in a.t.dims), a.t.data_type)
    return table


# --------------------------------------------------------------------------- graph structure


def _check_structure(g: onnx.GraphProto, path: str) -> list[int]:
    """Topological order of node indices; errors for dangling inputs and cycles."""
    producer: dict[str, int] = {}
    for i, n in enumerate(g.node):
        for o in n.output:
            if o:
                producer[o] = i
    available = {t.name for t in g.initializer} | {vi.name for vi in g.input}
    sorter: graphlib.TopologicalSorter = graphlib.TopologicalSorter()
    for i, n in enumerate(g.node):
        preds = []
        for name in n.input:
            if not name:
                continue  # omitted optional input
            if name in producer:
                preds.append(producer[name])
            elif name not in available:
                raise OpschedError(
                    f"{path}: node '{n.name or n.op_type}' reads tensor '{name}' that no node, "
                    "initializer or graph input provides (dangling input); re-export the model"
                )
        sorter.add(i, *preds)
    try:
        return list(sorter.static_order())
    except graphlib.CycleError as exc:
        stuck = exc.args[1][0]
        raise OpschedError(
            f"{path}: the ONNX graph has a cycle (through node '{g.node[stuck].name or g.node[stuck].op_type}'); "
            "an ONNX graph must be acyclic"
        ) from None


def _small_int_values(model: onnx.ModelProto) -> dict[str, list[int]]:
    """Values of tiny integer constants (initializers and Constant nodes), e.g. a TopK's K."""
    out: dict[str, list[int]] = {}
    int_types = {TensorProto.INT64, TensorProto.INT32}

    def grab(name, t):
        tiny = len(t.dims) <= 1 and _numel(t.dims) <= 8
        if t.data_type in int_types and tiny and t.data_location != TensorProto.EXTERNAL:
            try:
                out[name] = [int(x) for x in numpy_helper.to_array(t).reshape(-1)]
            except Exception:  # malformed tiny constant: just unknown
                pass

    for t in model.graph.initializer:
        grab(t.name, t)
    for n in model.graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    grab(n.output[0], a.t)
                elif a.name == "value_int":
                    out[n.output[0]] = [int(a.i)]
                elif a.name == "value_ints":
                    out[n.output[0]] = [int(x) for x in a.ints]
    return out


# --------------------------------------------------------------------------- MoE routing


def _pin_nonzero(model, shapes, capacity_factor, warnings, routing, masks) -> bool:
    """Give each NonZero with an unknown count a static output shape. True if any changed.

    One below a router TopK is expert routing, sized by balanced routing and
    recorded in ``routing``; any other (a mask, such as LLaVA's image-token
    merge) is taken as all nonzero, recorded in ``masks`` with a warning, and
    never called routing.
    """
    g = model.graph
    producer = {o: n for n in g.node for o in n.output if o}
    small = None
    pins: dict[str, list[int]] = {}
    for n in g.node:
        if n.op_type != "NonZero":
            continue
        out_shape, _ = shapes.get(n.output[0], (None, 0))
        if _static(out_shape):
            continue
        in_shape, _ = shapes.get(n.input[0], (None, 0))
        if not _static(in_shape):
            continue  # its input is not known yet: a later pass
        if small is None:
            small = _small_int_values(model)
        key = n.name or n.output[0]
        count = _routed_count(n, producer, shapes, small, capacity_factor)
        if count is None:
            count = max(1, _numel(in_shape))
            masks[key] = count
            warnings.append(
                f"NonZero '{key}' has a data-dependent count and no MoE router (TopK) above it, so it is a mask, "
                f"not expert routing (e.g. LLaVA's merge of image features into the text); assumed all {count:,} "
                "elements nonzero, the most it can cost"
            )
        else:
            count = min(max(1, count), max(1, _numel(in_shape)))
            routing[key] = count
        pins[n.output[0]] = [len(in_shape), count]
    if not pins:
        return False
    kept = [vi for vi in g.value_info if vi.name not in pins]
    del g.value_info[:]
    g.value_info.extend(kept)
    g.value_info.extend(onnx.helper.make_tensor_value_info(name, TensorProto.INT64, shape)
                        for name, shape in pins.items())
    return True


def _routed_count(nonzero, producer, shapes, small, capacity_factor) -> int | None:
    """ceil(cf * tokens * top_k / num_experts) from the nearest TopK above ``nonzero``."""
    seen = set()
    queue = deque([nonzero])
    while queue:
        node = queue.popleft()
        for name in node.input:
            p = producer.get(name)
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            if p.op_type == "TopK":
                x_shape, _ = shapes.get(p.input[0], (None, 0))
                k = small.get(p.input[1]) if len(p.input) > 1 else None
                if k is None:
                    k = [_attr(p, "k")] if _attr(p, "k") is not None else None
                if _static(x_shape) and x_shape and k:
                    axis = _attr(p, "axis", -1) % len(x_shape)
                    experts = x_shape[axis]
                    tokens = _numel(x_shape) // max(1, experts)
                    return math.ceil(capacity_factor * tokens * k[0] / max(1, experts) - 1e-9)
            queue.append(p)
    return None


# --------------------------------------------------------------------------- scopes


def node_scope(node) -> tuple[str, ...]:
    """Module path of a node from dynamo metadata or a legacy ``/a/b/Op`` name.

    >>> import onnx
    >>> node_scope(onnx.helper.make_node("MatMul", ["a", "b"], ["c"], name="/model/layers.3/mlp/experts.1/w1/MatMul"))
    ('model', 'layers.3', 'mlp', 'experts.1', 'w1')
    """
    for p in node.metadata_props:
        if p.key == NAME_SCOPES_KEY:
            return _dynamo_scope(p.value)
    name = node.name
    if name.startswith("/"):
        return tuple(part for part in name.split("/")[1:-1] if part)
    return ()


#: the scope torch's exporter gives a node traced outside every module (torch.export's metadata hook)
NO_MODULE_PLACEHOLDER = "_empty_nn_module_stack_from_metadata_hook"


def _dynamo_scope(text: str) -> tuple[str, ...]:
    """The module path of a dynamo ``name_scopes`` list.

    >>> _dynamo_scope("['', 'model', 'model.layers.0', 'MatMul']"), _dynamo_scope(f"['{NO_MODULE_PLACEHOLDER}', 'sym_size_int_44']")
    (('model', 'layers.0'), ())
    """
    try:
        items = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return ()
    if not isinstance(items, (list, tuple)):
        return ()
    # the last item is the leaf op; torch names the module of a node it traced outside every module (a shape
    # read) with a placeholder, which is no module of the model
    modules = [str(x) for x in items[:-1] if str(x) and str(x) != NO_MODULE_PLACEHOLDER]
    out: list[str] = []
    full = ""
    for m in modules:
        if full and m.startswith(full + "."):
            rel = m[len(full) + 1:]  # full dotted path: keep the new part
            full = m
        else:
            rel = m
            full = f"{full}.{m}" if full else m
        out.extend(_split_module_path(rel))
    return tuple(out)


_INDEX = re.compile(r"^\d+$")


def _split_module_path(rel: str) -> list[str]:
    """``"encoder.layers.0"`` -> ``["encoder", "layers.0"]``: an index stays with its container."""
    parts = rel.split(".")
    out: list[str] = []
    for part in parts:
        if _INDEX.match(part) and out:
            out[-1] = f"{out[-1]}.{part}"
        else:
            out.append(part)
    return out


# --------------------------------------------------------------------------- main entry


@gc_paused()
def import_onnx(path, dims: dict[str, int] | None = None, capacity_factor: float = 1.0,
                strict_dims: bool = False) -> nx.DiGraph:
    """Read an ONNX model into an OpGraph with per-operator forward costs.

    ``dims`` sets symbolic dimensions (overriding the model's
    ``opsched.default_dims`` metadata); a name the model does not have is a
    warning, or an error with ``strict_dims``; ``capacity_factor`` scales the
    balanced-routing token count of data-dependent MoE loops. See the module
    docstring for every rule. Raises :class:`OpschedError` on bad input.
    """
    if not (capacity_factor > 0 and math.isfinite(capacity_factor)):
        raise OpschedError(f"capacity factor must be a positive number, got {capacity_factor}")
    path = os.fspath(path)
    model = load_model(path)
    warnings: list[str] = []
    if model.functions:
        try:
            model = onnx.inliner.inline_local_functions(model)
        except Exception:  # keep the calls as unknown ops
            warnings.append("could not inline the model's local functions; their calls cost bytes only")
    order = _check_structure(model.graph, path)
    resolved = resolve_dims(model, dims, warnings, strict=strict_dims)
    symbolic = symbolic_dim_names(model)  # before they take their values
    substitute_dims(model, resolved)
    model = _infer(model)
    routing: dict[str, int] = {}
    masks: dict[str, int] = {}
    shapes = _shape_table(model)
    for _ in range(8):  # NonZero pins may unlock further NonZeros downstream
        if not _pin_nonzero(model, shapes, capacity_factor, warnings, routing, masks):
            break
        model, shapes = _infer_after_pins(model)
    meta = model_metadata(model)
    data_meta = [s.strip() for s in meta[DATA_INPUTS_KEY].split(",") if s.strip()] if DATA_INPUTS_KEY in meta else None
    weight_inputs = _weight_inputs(model, shapes, data_meta)
    exported_batch = find_static_batch(model, weight_inputs, symbolic, resolved, dims, warnings, strict_dims)
    batch_scale = resolved[BATCH] / exported_batch if exported_batch else 1.0
    keys = _node_keys(model.graph.node)
    scopes = [node_scope(n) for n in model.graph.node]
    g = _build_graph(model, path, order, shapes, resolved, weight_inputs, warnings, capacity_factor, routing, masks,
                     keys, scopes, batch_scale)
    mark_grouped_kv_heads(g, model, keys, shapes)
    g.graph["static_batch"] = exported_batch
    _split_stacked_experts(g, model, order, shapes, weight_inputs, capacity_factor, keys, scopes)
    mark_activation_checkpoints(g)  # after the split: stacked experts' activations are per expert only then
    mark_moe_layers(g)
    return g


def routing_assumptions(g: nx.DiGraph) -> list[str]:
    """The MoE routing the import assumed, a sentence each (none for a model without data-dependent routing).

    ``inspect`` prints these and ``plan`` carries them into report.md and
    plan.json's ``warnings``, next to the import's own ``warnings``
    (:func:`import_warnings`). A NonZero that is not below a router is never
    counted here: it is a mask, and its warning says so.

    >>> from opsched.model.graph import new_op_graph
    >>> routing_assumptions(new_op_graph(moe_routing={"a": 3, "b": 3}, capacity_factor=1.25))
    ['MoE routing: 2 data-dependent expert selections (NonZero below a router TopK) sized by balanced routing: each expert gets ceil(1.25 x tokens x top_k / experts) tokens (--capacity-factor 1.25); uneven real routing makes the busiest expert slower than planned']
    """
    cf = g.graph.get("capacity_factor", 1.0)
    out = []
    routed = g.graph.get("moe_routing") or {}
    if routed:
        out.append(
            f"MoE routing: {plural(len(routed), 'data-dependent expert selection')} (NonZero below a router TopK) "
            f"sized by balanced routing: each expert gets ceil({cf:g} x tokens x top_k / experts) tokens "
            f"(--capacity-factor {cf:g}); uneven real routing makes the busiest expert slower than planned"
        )
    stacked = g.graph.get("stacked_experts") or {}
    if stacked:
        counts = "/".join(str(c) for c in sorted({f["experts"] for f in stacked.values()}))
        out.append(
            f"MoE routing: {plural(len(stacked), 'layer')} of stacked [experts, ...] weights split into {counts} "
            f"experts each, each expert's rows by balanced routing (--capacity-factor {cf:g}); uneven real routing "
            "makes the busiest expert slower than planned"
        )
    return out


def import_warnings(g: nx.DiGraph) -> list[str]:
    """Every assumption and warning of the import, a sentence each: the MoE routing assumed, then the warnings."""
    return routing_assumptions(g) + list(g.graph.get("warnings") or [])


def _split_stacked_experts(g, model, order, shapes, weight_inputs, capacity_factor, keys, scopes) -> None:
    """Experts stored as one ``[E, ...]`` weight become E per-expert copies (rule 7, :mod:`opsched.model.stacked_experts`)."""
    nodes = model.graph.node
    sizes = router_sizes(nodes, shapes, _small_int_values(model))
    found: dict[str, dict] = {}
    if sizes:
        weights = {t.name for t in model.graph.initializer if t.data_type in _FLOAT_TYPES} | set(weight_inputs)
        stacked = stacked_weights(nodes, order, shapes, weights, sizes)
        families = find_families(nodes, order, shapes, stacked, scopes, capacity_factor)
        split_families(g, families, keys)
        found = {f.name: {"experts": f.experts, "rows": f.rows, "rows_per_expert": f.rows and round(f.rows * f.per_expert)}
                 for f in families}
    g.graph["stacked_experts"] = found
