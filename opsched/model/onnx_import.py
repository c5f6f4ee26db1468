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
import dataclasses
import difflib
import graphlib
import math
import os
import re
from collections import deque

import networkx as nx
import onnx
from onnx import TensorProto, numpy_helper

from opsched.errors import OpschedError
from opsched.model.gemm import GemmShape, matmul_shape, padded_flops
from opsched.model.graph import OpNode, gc_paused, new_op_graph
from opsched.model.saved import NO_GRADIENT, VIEW_OPS, saved_tensors
from opsched.model.stacked_experts import find_families, router_sizes, split_families, stacked_weights
from opsched.units import plural

DEFAULT_DIMS_KEY = "opsched.default_dims"
DATA_INPUTS_KEY = "opsched.data_inputs"
NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"

# Bytes per element of each TensorProto data type (sub-byte types as fractions).
_DTYPE_BYTES = {
    TensorProto.FLOAT: 4, TensorProto.UINT8: 1, TensorProto.INT8: 1, TensorProto.UINT16: 2,
    TensorProto.INT16: 2, TensorProto.INT32: 4, TensorProto.INT64: 8, TensorProto.STRING: 8,
    TensorProto.BOOL: 1, TensorProto.FLOAT16: 2, TensorProto.DOUBLE: 8, TensorProto.UINT32: 4,
    TensorProto.UINT64: 8, TensorProto.COMPLEX64: 8, TensorProto.COMPLEX128: 16,
    TensorProto.BFLOAT16: 2,
}
for _name, _size in (("FLOAT8E4M3FN", 1), ("FLOAT8E4M3FNUZ", 1), ("FLOAT8E5M2", 1),
                     ("FLOAT8E5M2FNUZ", 1), ("FLOAT8E8M0", 1), ("UINT4", 0.5), ("INT4", 0.5),
                     ("FLOAT4E2M1", 0.5), ("UINT2", 0.25), ("INT2", 0.25)):
    if hasattr(TensorProto, _name):
        _DTYPE_BYTES[getattr(TensorProto, _name)] = _size

_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}
_FLOAT_TYPES |= {v for k, v in TensorProto.DataType.items() if k.startswith("FLOAT8") or k.startswith("FLOAT4")}

# Ops that only move, copy or index data: bytes, no FLOPs.
BYTES_ONLY_OPS = frozenset("""
Gather GatherElements GatherND Scatter ScatterElements ScatterND Reshape Transpose Concat Split
SplitToSequence Slice Squeeze Unsqueeze Flatten Expand Tile Pad Cast CastLike Identity Shape Size
Constant ConstantOfShape Range NonZero OneHot DepthToSpace SpaceToDepth Trilu Dropout Compress
Unique EyeLike ReverseSequence Resize Upsample Col2Im Optional OptionalGetElement
OptionalHasElement SequenceAt SequenceConstruct SequenceEmpty SequenceErase SequenceInsert
SequenceLength ConcatFromSequence TensorScatter
""".split())

ELEMENTWISE_OPS = frozenset("""
Add Sub Mul Div Pow Mod Neg Abs Reciprocal Sqrt Exp Log Relu LeakyRelu PRelu Elu Selu Celu Gelu
Sigmoid HardSigmoid HardSwish Tanh Softplus Softsign Mish Swish Erf Sin Cos Tan Asin Acos Atan Sinh
Cosh Asinh Acosh Atanh Floor Ceil Round Sign Clip Min Max Mean Sum Where Equal Less LessOrEqual
Greater GreaterOrEqual Not And Or Xor BitShift BitwiseAnd BitwiseOr BitwiseXor BitwiseNot IsNaN
IsInf ThresholdedRelu Shrink QuickGelu FastGelu BiasGelu
""".split())

REDUCE_OPS = frozenset("""
ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceLogSum ArgMax ArgMin
""".split())
REDUCE2_OPS = frozenset({"ReduceL2", "ReduceSumSquare", "ReduceLogSumExp"})
POOL_OPS = frozenset({"MaxPool", "AveragePool", "LpPool"})
GLOBAL_POOL_OPS = frozenset({"GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"})
PER_ELEMENT = {
    "LayerNormalization": 8, "BatchNormalization": 8, "InstanceNormalization": 8,
    "GroupNormalization": 8, "RMSNormalization": 4, "SimplifiedLayerNormalization": 4,
    "SkipLayerNormalization": 9, "SkipSimplifiedLayerNormalization": 5,
    "Softmax": 5, "LogSoftmax": 5, "Hardmax": 2, "LpNormalization": 3,
    "MeanVarianceNormalization": 6, "TopK": 1, "CumSum": 1,
}

# Ops whose output is the same weight under another name or layout.
ALIAS_OPS = frozenset({"Identity", "Transpose", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})
NORM_OPS = frozenset({"LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization",
                      "GroupNormalization", "InstanceNormalization", "BatchNormalization",
                      "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"})
SHAPE_READERS = frozenset({"Shape", "Size"})
# Exporters deduplicate equal-valued weights up to this many elements (norm scales, zero biases).
DEDUP_LIMIT = 1024


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


def parse_dims(text: str, source: str = "dims") -> dict[str, int]:
    """Parse ``"batch=1,seq=4096"`` into ``{"batch": 1, "seq": 4096}``.

    >>> parse_dims("batch=1, seq=4096")
    {'batch': 1, 'seq': 4096}
    """
    out: dict[str, int] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        out.update(parse_dim(item, source))
    return out


def parse_dim(item: str, source: str | None = None) -> dict[str, int]:
    """Parse one ``NAME=VALUE`` with a positive integer value; ``source`` names where it came from in the error.

    Without ``source`` the error leaves it out, for argparse, which puts the flag's name in front itself:

    >>> parse_dim("seqlen")
    Traceback (most recent call last):
    ...
    opsched.errors.OpschedError: bad dimension 'seqlen': write NAME=VALUE with a positive integer, e.g. seq=4096
    """
    name, sep, value = item.partition("=")
    name = name.strip()
    try:
        number = int(value.strip())
    except ValueError:
        number = 0
    if not sep or not name or number <= 0:
        where = f" in {source}" if source else ""
        raise OpschedError(
            f"bad dimension {item!r}{where}: write NAME=VALUE with a positive integer, e.g. seq=4096")
    return {name: number}


def _metadata(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


# --------------------------------------------------------------------------- dims and shapes


def _eval_dim_expr(expr: str, dims: dict[str, int]) -> int | None:
    """Evaluate an exporter's symbolic dim expression (``"2*s0"``) with known dims, or None."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in dims:
                raise KeyError(node.id)
            return dims[node.id]
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b,
                   ast.FloorDiv: lambda: a // b, ast.Mod: lambda: a % b,
                   ast.Div: lambda: a // b if b and a % b == 0 else None}
            f = ops.get(type(node.op))
            if f is None:
                raise ValueError(expr)
            return f()
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(expr)

    try:
        value = ev(tree)
    except (KeyError, ValueError, ZeroDivisionError, TypeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _resolve_dims(model: onnx.ModelProto, dims: dict[str, int] | None, warnings: list[str],
                  strict: bool = False) -> dict[str, int]:
    """Defaults from metadata, overridden by ``dims``; error on any unresolved graph-input dim.

    A name in ``dims`` the model does not have is a warning, or with ``strict`` an error naming the ones it has.
    """
    meta = _metadata(model)
    resolved: dict[str, int] = {}
    defaults: dict[str, int] = {}
    if DEFAULT_DIMS_KEY in meta:
        defaults = parse_dims(meta[DEFAULT_DIMS_KEY], f"the model's {DEFAULT_DIMS_KEY} metadata")
        resolved.update(defaults)
    for name, value in (dims or {}).items():
        try:
            number = int(value)
        except (TypeError, ValueError):
            number = 0
        if number <= 0 or number != value:
            raise OpschedError(f"dimension {name}={value!r} must be a positive integer: --dim {name}=VALUE")
        resolved[name] = number
    init_names = {t.name for t in model.graph.initializer}
    missing: dict[str, str] = {}
    used: set[str] = set()
    for vi in model.graph.input:
        if vi.name in init_names or not vi.type.HasField("tensor_type"):
            continue
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                continue
            if d.HasField("dim_param") and d.dim_param:
                value = resolved.get(d.dim_param)
                if value is None:
                    value = _eval_dim_expr(d.dim_param, resolved)
                if value is None:
                    missing.setdefault(d.dim_param, vi.name)
                used.add(d.dim_param)
            else:
                raise OpschedError(
                    f"graph input '{vi.name}' has an unnamed dynamic dimension (axis {axis}); "
                    "re-export with named dynamic dims so it can be set with --dim NAME=VALUE"
                )
    if missing:
        names = ", ".join(f"'{k}' (input '{v}')" for k, v in sorted(missing.items()))
        flags = " ".join(f"--dim {k}=VALUE" for k in sorted(missing))
        raise OpschedError(f"unresolved symbolic dimension {names}: set it with {flags}")
    # names inside expressions such as "2*s0" count as used; so do the model's own default dims
    known = {name for expr in used for name in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expr)}
    unknown = sorted(set(dims or {}) - known - set(defaults))
    if unknown and strict:
        raise OpschedError(unknown_dim_message(unknown[0], known | set(defaults)))
    unused = sorted(set(dims or {}) - known)
    if unused:
        warnings.append(f"dims not used by any graph input: {', '.join(unused)}")
    return resolved


def unknown_dim_message(name: str, names: set[str]) -> str:
    """The error for a ``--dim`` name the model does not have: its dimensions, and the closest one to the typo.

    >>> unknown_dim_message("seqlen", {"batch", "seq"})
    "--dim seqlen: the model has no symbolic dimension 'seqlen' (did you mean seq?); its dimensions are batch, seq"
    >>> unknown_dim_message("seq", set())
    "--dim seq: the model has no symbolic dimension 'seq'; its dimensions are none (every input shape is fixed)"
    """
    close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]}?)" if close else ""
    listed = ", ".join(sorted(names)) or "none (every input shape is fixed)"
    return f"--dim {name}: the model has no symbolic dimension {name!r}{hint}; its dimensions are {listed}"


def _set_dims(tensor_type, dims: dict[str, int], keep_unknown: bool) -> None:
    """Replace symbolic dims by values in place; drop (make unknown) what cannot be evaluated."""
    for d in tensor_type.shape.dim:
        if d.HasField("dim_param"):
            value = dims.get(d.dim_param) or _eval_dim_expr(d.dim_param, dims)
            if value is not None:
                d.dim_value = value
            elif not keep_unknown:
                d.Clear()


def _substitute_dims(model: onnx.ModelProto, dims: dict[str, int]) -> None:
    g = model.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            _set_dims(vi.type.tensor_type, dims, keep_unknown=False)


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


def _static(shape) -> bool:
    return shape is not None and None not in shape


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


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


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


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


# --------------------------------------------------------------------------- costs


def op_flops(op_type: str, node, in_shapes: list, out_shapes: list) -> float | None:
    """Forward FLOPs of one node from its input and output shapes.

    Returns 0.0 for data-movement ops, ``None`` when the op type is unknown or a
    shape it needs is unknown. See the module docstring for the formulas.

    >>> import onnx
    >>> n = onnx.helper.make_node("MatMul", ["a", "b"], ["c"])
    >>> op_flops("MatMul", n, [(2, 3, 4), (4, 5)], [(2, 3, 5)])  # 2 * K * outputs = 2 * 4 * 30
    240.0
    """
    if op_type in BYTES_ONLY_OPS:
        return 0.0
    out0 = out_shapes[0] if out_shapes else None
    in0 = in_shapes[0] if in_shapes else None
    if op_type in ("MatMul", "MatMulInteger", "FusedMatMul"):
        if not _static(in0) or not _static(out0) or not in0:
            return None
        return 2.0 * in0[-1] * _numel(out0)
    if op_type == "Gemm":
        if not _static(in0) or not _static(out0) or len(in0) != 2:
            return None
        k = in0[0] if _attr(node, "transA", 0) else in0[1]
        bias = _numel(out0) if len(in_shapes) > 2 and in_shapes[2] is not None and node.input[2] else 0
        return 2.0 * k * _numel(out0) + bias
    if op_type in ("Conv", "ConvInteger"):
        w = in_shapes[1] if len(in_shapes) > 1 else None
        if not _static(w) or not _static(out0):
            return None
        per_out = _numel(w[1:])  # (C_in / group) * kernel
        bias = _numel(out0) if len(in_shapes) > 2 and node.input[2] else 0
        return 2.0 * _numel(out0) * per_out + bias
    if op_type == "ConvTranspose":
        w = in_shapes[1] if len(in_shapes) > 1 else None
        if not _static(w) or not _static(in0) or not _static(out0):
            return None
        per_in = _numel(w[1:])  # (C_out / group) * kernel, per input element
        bias = _numel(out0) if len(in_shapes) > 2 and node.input[2] else 0
        return 2.0 * _numel(in0) * per_in + bias
    if op_type == "Einsum":
        return _einsum_flops(node, in_shapes)
    if op_type == "Attention":
        return _attention_flops(node, in_shapes)
    if op_type in PER_ELEMENT:
        base = in0 if op_type in ("TopK", "CumSum") else (in0 or out0)
        if not _static(base):
            return None
        per = PER_ELEMENT[op_type]
        if op_type == "LayerNormalization" and (len(node.input) < 3 or not node.input[2]):
            per -= 1
        return float(per * _numel(base))
    if op_type in ELEMENTWISE_OPS:
        if not _static(out0):
            return None
        return float(_numel(out0))
    if op_type in REDUCE_OPS or op_type in REDUCE2_OPS:
        if not _static(in0):
            return None
        return float((2 if op_type in REDUCE2_OPS else 1) * _numel(in0))
    if op_type in POOL_OPS:
        kernel = _attr(node, "kernel_shape")
        if not _static(out0) or not kernel:
            return None
        return float(_numel(out0) * _numel(kernel))
    if op_type in GLOBAL_POOL_OPS:
        return float(_numel(in0)) if _static(in0) else None
    return None


def _einsum_flops(node, in_shapes) -> float | None:
    eq = (_attr(node, "equation") or b"")
    eq = eq.decode() if isinstance(eq, bytes) else eq
    lhs = eq.replace(" ", "").split("->")[0]
    terms = lhs.split(",")
    if len(terms) != len(in_shapes) or "." in lhs:
        return None
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, in_shapes):
        if not _static(shape) or len(term) != len(shape):
            return None
        for letter, d in zip(term, shape):
            sizes[letter] = max(sizes.get(letter, 1), d)
    if len(terms) == 1:
        return float(_numel(in_shapes[0]))
    return float(len(terms) * _numel(sizes.values()))


def _attention_flops(node, in_shapes) -> float | None:
    dims = _attention_dims(node, in_shapes)
    if dims is None:
        return None
    scores = dims.scores
    return float(2 * scores * (dims.dqk + dims.dv) + 6 * scores)


@dataclasses.dataclass(frozen=True)
class _AttentionDims:
    """An ``Attention`` op's sizes: ``batch × heads`` score matrices of ``sq × skv``, head dims ``dqk`` and ``dv``."""

    batch_heads: int
    sq: int
    skv: int
    dqk: int
    dv: int

    @property
    def scores(self) -> int:
        return self.batch_heads * self.sq * self.skv

    def gemm_padded_flops(self) -> float:
        """Q·Kᵀ and scores·V as the batched GEMMs an unfused attention runs, padded to their tiles (opsched.model.gemm).

        >>> _AttentionDims(batch_heads=2, sq=128, skv=128, dqk=96, dv=96).gemm_padded_flops() == 2 * 2 * 2 * 128 * 128 * 128
        True
        """
        qk = GemmShape(m=self.sq, n=self.skv, k=self.dqk, batch=self.batch_heads)
        pv = GemmShape(m=self.sq, n=self.dv, k=self.skv, batch=self.batch_heads)
        return padded_flops(qk) + padded_flops(pv)


def _attention_dims(node, in_shapes) -> _AttentionDims | None:
    q, k, v = (in_shapes + [None, None, None])[:3]
    if not (_static(q) and _static(k) and _static(v)):
        return None
    if len(q) == 4:
        b, h, sq, dqk = q
        skv, dv = k[2], v[3]
    elif len(q) == 3:
        hq = _attr(node, "q_num_heads")
        hkv = _attr(node, "kv_num_heads")
        if not hq or not hkv:
            return None
        b, sq, h = q[0], q[1], hq
        dqk, skv, dv = q[2] // hq, k[1], v[2] // hkv
    else:
        return None
    past = in_shapes[4] if len(in_shapes) > 4 else None
    if _static(past) and len(past) == 4:
        skv += past[2]
    return _AttentionDims(batch_heads=b * h, sq=sq, skv=skv, dqk=dqk, dv=dv)


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


def _dynamo_scope(text: str) -> tuple[str, ...]:
    try:
        items = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return ()
    if not isinstance(items, (list, tuple)):
        return ()
    modules = [str(x) for x in items[:-1] if str(x)]  # the last item is the leaf op
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


# --------------------------------------------------------------------------- parameters


def _weight_inputs(model, shapes, data_meta: list[str] | None) -> set[str]:
    """Graph inputs that are weights (see the module docstring for the rule)."""
    g = model.graph
    init_names = {t.name for t in g.initializer}
    inputs = [vi for vi in g.input if vi.name not in init_names]
    if data_meta is not None:
        return {vi.name for vi in inputs} - set(data_meta)
    consumers: dict[str, list] = {}
    for n in g.node:
        for k, name in enumerate(n.input):
            if name:
                consumers.setdefault(name, []).append((n, k))
    weights = set()
    for vi in inputs:
        shape, elem = shapes.get(vi.name, (None, 0))
        if elem not in _FLOAT_TYPES or not _static(shape):
            continue
        if _read_as_weight(vi.name, consumers, shapes):
            weights.add(vi.name)
    return weights


def _read_as_weight(name, consumers, shapes, depth=0) -> bool:
    """True when every read of ``name`` (following alias ops) is in a weight position."""
    reads = consumers.get(name, [])
    if not reads:
        return False
    for n, k in reads:
        if n.op_type in ALIAS_OPS and k == 0 and depth < 4:
            if not _read_as_weight(n.output[0], consumers, shapes, depth + 1):
                return False
        elif not _weight_position(n, k, shapes, strong=True):
            return False
    return True


def _weight_position(node, k, shapes, strong: bool) -> bool:
    """Whether input ``k`` of ``node`` is where a weight goes."""
    t = node.op_type
    if t in ("MatMul", "Gemm", "Einsum", "MatMulInteger", "FusedMatMul"):
        return k >= 1 or not strong
    if t in ("Conv", "ConvTranspose", "ConvInteger", "PRelu"):
        return k >= 1
    if t in NORM_OPS:
        return 1 <= k <= (2 if t != "SkipLayerNormalization" else 4)
    if t in ("Gather", "GatherND"):
        return k == 0
    if t in ("Add", "Sub", "Mul", "Div"):
        if not strong:
            return True
        me = shapes.get(node.input[k], (None, 0))[0]
        others = [shapes.get(x, (None, 0))[0] for j, x in enumerate(node.input) if j != k]
        return me is not None and any(o is not None and len(o) > len(me) for o in others)
    return False


#: operators that read only the rows (elements) their indices select from input 0 (what their io_bytes charge)
GATHERS = ("Gather", "GatherND", "GatherElements")


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
    resolved = _resolve_dims(model, dims, warnings, strict=strict_dims)
    _substitute_dims(model, resolved)
    model = _infer(model)
    routing: dict[str, int] = {}
    masks: dict[str, int] = {}
    shapes = _shape_table(model)
    for _ in range(8):  # NonZero pins may unlock further NonZeros downstream
        if not _pin_nonzero(model, shapes, capacity_factor, warnings, routing, masks):
            break
        model, shapes = _infer_after_pins(model)
    meta = _metadata(model)
    data_meta = [s.strip() for s in meta[DATA_INPUTS_KEY].split(",") if s.strip()] if DATA_INPUTS_KEY in meta else None
    weight_inputs = _weight_inputs(model, shapes, data_meta)
    keys = _node_keys(model.graph.node)
    scopes = [node_scope(n) for n in model.graph.node]
    g = _build_graph(model, path, order, shapes, resolved, weight_inputs, warnings, capacity_factor, routing, masks,
                     keys, scopes)
    _split_stacked_experts(g, model, order, shapes, weight_inputs, capacity_factor, keys, scopes)
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


def _tensor_bytes(shapes, name) -> float:
    """Bytes of one tensor (0 when its shape is unknown)."""
    shape, elem = shapes.get(name, (None, 0))
    return float(_numel(shape) * _DTYPE_BYTES.get(elem, 4)) if _static(shape) else 0.0


class _BytesOf(dict):
    """Memoised tensor name -> bytes for one shape table."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes = shapes

    def __missing__(self, name):
        value = self[name] = _tensor_bytes(self.shapes, name)
        return value


def _exporter(model) -> str:
    if model.producer_name.lower().startswith("pytorch"):
        for n in model.graph.node[:50]:
            if any(p.key == NAME_SCOPES_KEY for p in n.metadata_props):
                return "dynamo"
        return "legacy"
    return "helper"


#: ops that run as matrix multiplies on tensor cores (their FLOPs and bytes are costed apart, cost.compute_time)
MATMUL_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "MatMulInteger", "FusedMatMul",
                        "ConvInteger"})

# Op types op_flops knows how to cost: None for one of these means its shapes are unknown.
_COSTED_OPS = (ELEMENTWISE_OPS | frozenset(PER_ELEMENT) | REDUCE_OPS | REDUCE2_OPS | POOL_OPS | GLOBAL_POOL_OPS
               | {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention", "MatMulInteger", "FusedMatMul",
                  "ConvInteger"})


def _build_graph(model, path, order, shapes, dims, weight_inputs, warnings, capacity_factor, routing, masks, keys,
                 scopes):
    """One OpNode per ONNX node, in topological ``order``, and one edge per tensor read from another node.

    ``keys`` and ``scopes`` are per node index (:func:`_node_keys`, :func:`node_scope`).
    Nodes and edges go into the graph in two bulk calls, in the order they are met (the
    order coarsening's topological sort sees).
    """
    g_onnx = model.graph
    init_names = {t.name for t in g_onnx.initializer}
    graph_inputs = [vi.name for vi in g_onnx.input if vi.name not in init_names]
    data_inputs = [n for n in graph_inputs if n not in weight_inputs]
    name = g_onnx.name or os.path.splitext(os.path.basename(path))[0]
    g = new_op_graph(name, dims=dict(dims), warnings=warnings, exporter=_exporter(model),
                     capacity_factor=capacity_factor, data_inputs=data_inputs, source=os.path.basename(path),
                     moe_routing=routing, nonzero_masks=masks)
    weights = _ParamCounter(g_onnx, weight_inputs, shapes)
    bytes_of = _BytesOf(shapes)
    const_tensors = set(init_names) | set(weight_inputs)
    producer: dict[str, str] = {}  # tensor -> key of the node writing it
    unknown: dict[str, int] = {}  # op type -> count of nodes op_flops cannot cost
    uncosted: list[str] = []  # keys of costed op types whose shapes are unknown
    tensor_bytes: dict[str, float] = {}
    readers: dict[str, list] = {}  # tensor -> the nodes reading it
    for n in g_onnx.node:
        for x in n.input:
            if x:
                readers.setdefault(x, []).append(n)
    nodes: list[tuple[str, dict]] = []
    split_tensors: set[str] = set()  # activations each tensor-parallel rank holds a part of (see _split_over_tensor_ranks)
    kept = _KeptActivations(weights, const_tensors, bytes_of, readers)
    unfused = _UnfusedAttention(nodes, kept)
    edges: dict[tuple[str, str], dict] = {}  # (writer, reader) -> bytes and tensors, in the order met
    for i in order:
        n = g_onnx.node[i]
        key, op_type = keys[i], n.op_type
        inputs, outputs = list(n.input), [o for o in n.output if o]
        flops = _node_flops(n, shapes)
        if flops is None:
            if op_type in _COSTED_OPS:
                uncosted.append(key)
            else:
                unknown[op_type] = unknown.get(op_type, 0) + 1
            flops = 0.0
        param_count, param_bytes = weights.read_by(n)
        out_bytes = sum(bytes_of[o] for o in outputs)
        in_bytes = sum(bytes_of[x] for x in inputs if x)
        if op_type in GATHERS and inputs and inputs[0]:
            # a gather reads the rows it selects (its output), not its whole table: an embedding lookup reads
            # a sequence's rows of the vocabulary, an MoE dispatch gather the tokens routed to one expert
            in_bytes += min(0.0, out_bytes - bytes_of[inputs[0]])
        # a vocabulary-parallel embedding (a Gather from a weight) all-reduces its output too
        row_parallel = param_count > 0 and (op_type == "Gather" or op_type in ("MatMul", "Gemm") and _feeds_residual(
            n.output[0], readers, const_tensors))
        kind = {"matmul": op_type in MATMUL_OPS, "attention": op_type == "Attention"}
        split = _split_over_tensor_ranks(op_type, inputs, param_count, row_parallel, split_tensors)
        if split:
            split_tensors.update(outputs)
        saved = kept.see(len(nodes), op_type, inputs, outputs)
        op = OpNode(key, op_type, scopes[i], flops=float(flops), param_count=int(param_count),
                    param_bytes=float(param_bytes), output_bytes=float(out_bytes), io_bytes=float(in_bytes + out_bytes),
                    tp_comm_bytes=float(out_bytes) if row_parallel else 0.0,
                    matmul_flops=float(flops) if kind["matmul"] else 0.0,
                    matmul_io_bytes=float(in_bytes + out_bytes) if kind["matmul"] else 0.0,
                    matmul_padded_flops=_matmul_padded_flops(n, shapes, flops) if kind["matmul"] else 0.0,
                    attention_flops=float(flops) if kind["attention"] else 0.0,
                    attention_io_bytes=float(in_bytes + out_bytes) if kind["attention"] else 0.0,
                    saved_bytes=float(sum(saved.values())),
                    tp_replicated_bytes=float(sum(b for t, b in saved.items() if t not in split_tensors)),
                    attention_kv_bytes=float(sum(bytes_of[x] for x in inputs[1:3] if x)) if kind["attention"] else 0.0,
                    **(_attention_unfused_fields(n, shapes) if kind["attention"] else {}))
        is_const = all((not x) or x in const_tensors for x in inputs)
        nodes.append((key, {"op": op, "const": is_const}))
        unfused.see(len(nodes) - 1, inputs, outputs, is_const, bytes_of)
        if is_const:
            const_tensors.update(outputs)
        _add_input_edges(edges, op_type, inputs, key, producer, bytes_of, tensor_bytes)
        producer.update((o, key) for o in outputs)
    g.add_nodes_from(nodes)
    g.add_edges_from((u, v, data) for (u, v), data in edges.items())
    warnings.extend(_cost_warnings(unknown, uncosted))
    g.graph["tensor_bytes"] = tensor_bytes
    return g


#: ops that only reshape or pass a tensor on, between a linear layer and the residual Add
_PASS_THROUGH = frozenset({"Reshape", "Identity", "Dropout", "Cast", "Squeeze", "Unsqueeze", "Flatten"})


class _KeptActivations:
    """The activations each node keeps for the backward (:mod:`opsched.model.saved`), each storage counted once.

    Walks the nodes in topological order, tracking which tensors need a
    gradient (parameters and what is computed from them), which storage a
    view shares, and which node keeps each storage first: that node's
    ``saved_bytes`` counts it. Weights and constants are no activations.
    """

    def __init__(self, weights: "_ParamCounter", const_tensors: set[str], bytes_of, readers: dict[str, list]):
        self.weights, self.const_tensors, self.bytes_of, self.readers = weights, const_tensors, bytes_of, readers
        self.silu_sigmoid: dict[str, str] = {}  # the output of a Sigmoid that is half of a SiLU -> its input
        self.gradient: set[str] = set()  # activations that need a gradient
        self.storage: dict[str, str] = {}  # view -> the tensor whose storage it shares
        self.keeper: dict[str, int] = {}  # storage tensor -> index of the first node keeping it
        self.producer: dict[str, int] = {}  # tensor -> index of the node writing it
        self.by_node: list[dict[str, float]] = []  # per node index: storage tensor -> bytes it keeps first

    def needs_gradient(self, name: str) -> bool:
        return name in self.gradient or self.weights.is_parameter(name)

    def see(self, index: int, op_type: str, inputs: list[str], outputs: list[str]) -> dict[str, float]:
        """Storage tensors node ``index`` keeps first, with their bytes; nodes must come in topological order."""
        mine: dict[str, float] = {}
        kept = saved_tensors(op_type, inputs, outputs, self.needs_gradient)
        if op_type == "Sigmoid" and inputs and outputs and self._silu_half(inputs[0], outputs[0]):
            # PyTorch's SiLU keeps only x, and recomputes the sigmoid in its backward; an export writes it as
            # x · sigmoid(x), whose rules alone would keep the sigmoid's output too (FFN-wide, per SwiGLU layer)
            self.silu_sigmoid[outputs[0]] = inputs[0]
            kept = ()
        elif op_type == "Mul" and any(self.silu_sigmoid.get(s) == x for x, s in (inputs, inputs[::-1])):
            kept = tuple(x for x in inputs if x not in self.silu_sigmoid)
        for name in kept:
            base = self.storage.get(name, name)
            if base not in self.const_tensors and base not in self.keeper:
                self.keeper[base] = index
                mine[base] = float(self.bytes_of[base])
        if op_type not in NO_GRADIENT and any(self.needs_gradient(x) for x in inputs if x):
            self.gradient.update(outputs[:1] if op_type == "TopK" else outputs)
        if inputs and (op_type in VIEW_OPS or op_type == "Dropout" and len(outputs) == 1):
            self.storage.update((o, self.storage.get(inputs[0], inputs[0])) for o in outputs)
        self.producer.update((o, index) for o in outputs)
        self.by_node.append(mine)
        return mine

    def _silu_half(self, x: str, sigmoid: str) -> bool:
        """Whether ``sigmoid`` = Sigmoid(``x``) is read by a ``Mul(x, sigmoid)``: SiLU written out."""
        return any(n.op_type == "Mul" and sorted(n.input) == sorted((x, sigmoid))
                   for n in self.readers.get(sigmoid, ()))

    def kept_from(self, index: int, writers: set[int]) -> float:
        """Bytes node ``index`` keeps first of tensors written by the nodes ``writers``."""
        return sum(b for t, b in self.by_node[index].items() if self.producer.get(t) in writers)


class _UnfusedAttention:
    """Marks attention cores an exporter wrote as operators: ``MatMul(Q, Kᵀ)`` → ... → ``Softmax`` → ... → ``MatMul(·, V)``.

    A MatMul of two activations (no weight, not constant) starts a chain;
    operators other than matmuls reading a chain's tensor extend it (scaling,
    mask, softmax, dropout, casts); a second such MatMul reading it after a
    Softmax closes it. The closed chain's operators become attention
    (``attention_flops``, ``attention_io_bytes``), the tensors before the
    closing MatMul its scores (``attention_scores_bytes``: what the chain
    keeps of them, Korthikanti et al.'s ``5·a·s²·b`` with dropout, the
    softmax's output without), and the two MatMuls' second inputs its keys and
    values (``attention_kv_bytes``). A router's Softmax reads a weight
    matmul's output, so it never starts a chain.
    """

    def __init__(self, nodes: list[tuple[str, dict]], kept: _KeptActivations):
        self.nodes, self.kept = nodes, kept
        self.chains: dict[str, tuple[tuple[int, ...], bool, float]] = {}  # tensor -> (node indices, softmax seen, K bytes)

    def see(self, index: int, inputs: list[str], outputs: list[str], is_const: bool, bytes_of) -> None:
        op = self.nodes[index][1]["op"]
        found = next((self.chains[x] for x in inputs if x in self.chains), None)
        activations_matmul = op.op_type in ("MatMul", "Einsum") and op.param_count == 0 and not is_const
        if activations_matmul and found is not None:
            if found[1]:  # attention over V closes the chain
                self._mark(found[0], index, found[2] + (bytes_of[inputs[1]] if len(inputs) > 1 else 0.0))
            return
        if activations_matmul:
            found = ((), False, bytes_of[inputs[1]] if len(inputs) > 1 else 0.0)
        elif found is None or op.op_type in MATMUL_OPS:
            return
        chain = (found[0] + (index,), found[1] or op.op_type == "Softmax", found[2])
        self.chains.update((o, chain) for o in outputs)

    def _mark(self, scores: tuple[int, ...], closing: int, kv_bytes: float) -> None:
        for i in (*scores, closing):
            data = self.nodes[i][1]
            op = data["op"]
            data["op"] = dataclasses.replace(
                op, attention_flops=op.flops, attention_io_bytes=op.io_bytes,
                attention_scores_bytes=self.kept.kept_from(i, set(scores)),
                attention_kv_bytes=kv_bytes if i == closing else 0.0)


def _split_over_tensor_ranks(op_type: str, inputs: list[str], param_count: float, row_parallel: bool,
                             split_tensors: set[str]) -> bool:
    """Whether Megatron's tensor parallelism leaves each rank a part of this op's output (else every rank holds it whole).

    A column-parallel layer (a weight matmul that is not row-parallel) splits
    its output over the ranks, and so does every op reading a split tensor,
    up to the row-parallel layer whose all-reduce makes the output whole
    again (Shoeybi et al. 2019). What is left whole (norms, residual adds,
    row-parallel outputs, the embedding) is what sequence parallelism splits
    along the sequence (Korthikanti et al. 2022, section 4.2.2).

    >>> _split_over_tensor_ranks("MatMul", ["x", "w"], 16, False, set())   # column-parallel
    True
    >>> _split_over_tensor_ranks("MatMul", ["h", "w2"], 16, True, {"h"})   # row-parallel: all-reduced
    False
    >>> _split_over_tensor_ranks("Add", ["x", "y"], 0, False, set())       # residual stream
    False
    """
    if row_parallel:
        return False
    if param_count > 0 and op_type in MATMUL_OPS:
        return True
    return any(x in split_tensors for x in inputs if x)


def _feeds_residual(tensor: str, readers: dict[str, list], const_tensors: set[str], depth: int = 3) -> bool:
    """Whether ``tensor`` reaches an Add of two activations, through bias Adds and shape-only ops.

    A bias Add (one constant input) and pass-through ops are followed up to
    ``depth`` steps; an Add whose other input is computed is the residual.
    """
    if depth == 0:
        return False
    for n in readers.get(tensor, ()):
        if n.op_type == "Add":
            other = [x for x in n.input if x != tensor]
            if other and all(x not in const_tensors for x in other):
                return True
            if _feeds_residual(n.output[0], readers, const_tensors, depth - 1):
                return True
        elif n.op_type in _PASS_THROUGH and n.output and _feeds_residual(n.output[0], readers, const_tensors,
                                                                          depth - 1):
            return True
    return False


def _node_keys(nodes) -> list[str]:
    """A unique OpGraph key per ONNX node: its name, else ``OpType_index``; repeats get ``#index``."""
    keys: list[str] = []
    used: set[str] = set()
    for i, n in enumerate(nodes):
        key = n.name or f"{n.op_type}_{i}"
        if key in used:
            key = f"{key}#{i}"
        used.add(key)
        keys.append(key)
    return keys


def _matmul_padded_flops(n, shapes, flops: float) -> float:
    """A matmul's FLOPs with its dimensions padded to the GEMM tile (``opsched.model.gemm``); ``flops`` if its shape is unknown.

    >>> import onnx
    >>> n = onnx.helper.make_node("MatMul", ["x", "w"], ["y"])
    >>> shapes = {"x": ((8, 4096), 0), "w": ((4096, 4096), 0), "y": ((8, 4096), 0)}
    >>> _matmul_padded_flops(n, shapes, 2.0 * 8 * 4096 * 4096) == 2.0 * 128 * 4096 * 4096   # 8 rows fill a 128-row tile
    True
    """
    in_shapes = _input_shapes(n, shapes)
    out_shape = shapes.get(n.output[0], (None, 0))[0] if n.output else None
    shape = matmul_shape(n.op_type, in_shapes, out_shape, trans_a=bool(_attr(n, "transA", 0)))
    if shape is None or shape.flops <= 0:
        return float(flops)
    # a Gemm's bias adds FLOPs outside the GEMM: scale the counted FLOPs by the padding
    return float(flops) * padded_flops(shape) / shape.flops


def _attention_unfused_fields(n, shapes) -> dict[str, float]:
    """An ``Attention`` op's ``attention_scores`` and ``attention_gemm_padded_flops`` (none if its shapes are unknown)."""
    dims = _attention_dims(n, _input_shapes(n, shapes))
    if dims is None:
        return {}
    return {"attention_scores": float(dims.scores), "attention_gemm_padded_flops": dims.gemm_padded_flops()}


def _input_shapes(n, shapes) -> list:
    """The static shapes of a node's inputs (None for an absent or unknown one), as the cost rules take them."""
    return [shapes.get(x, (None, 0))[0] if x else None for x in n.input]


def _node_flops(n, shapes) -> float | None:
    in_shapes = _input_shapes(n, shapes)
    out_shapes = [shapes.get(x, (None, 0))[0] if x else None for x in n.output]
    return op_flops(n.op_type, n, in_shapes, out_shapes)


class _ParamCounter:
    """Parameters each node reads, following weights through alias ops (rule 6 of the module docstring).

    The state lives across nodes: which tensors derive from a weight, and which
    big weights were counted already, so a weight read twice (maybe transposed)
    counts once.
    """

    def __init__(self, g_onnx, weight_inputs, shapes):
        self.shapes = shapes
        # Weight-derived tensor name -> the weight it comes from.
        self.weightlike = {t.name: t.name for t in g_onnx.initializer if t.data_type in _FLOAT_TYPES}
        self.weightlike.update((w, w) for w in weight_inputs)
        self.counted: set[str] = set()
        self.parameters: dict[str, bool] = {}  # weight -> is_parameter's answer

    def is_parameter(self, name: str) -> bool:
        """Whether tensor ``name`` is a weight (or a view of one) of at least two elements: a trained parameter."""
        weight = self.weightlike.get(name)
        if weight is None:
            return False
        known = self.parameters.get(weight)
        if known is None:
            shape, _ = self.shapes.get(weight, (None, 0))
            known = self.parameters[weight] = _static(shape) and _numel(shape) >= 2
        return known

    def read_by(self, n) -> tuple[int, float]:
        """(parameter count, parameter bytes) node ``n`` reads; nodes must come in topological order."""
        if n.op_type in ALIAS_OPS:
            # a view of a weight is that weight: its reader counts it, not the alias
            if n.input and n.input[0] in self.weightlike:
                for o in n.output:
                    if o:
                        self.weightlike[o] = self.weightlike[n.input[0]]
            return 0, 0.0
        count, nbytes = 0, 0.0
        for k, x in enumerate(n.input):
            if not (x and x in self.weightlike and _weight_position(n, k, self.shapes, strong=False)):
                continue
            shape, elem = self.shapes.get(x, (None, 0))
            if not _static(shape) or _numel(shape) < 2:
                continue
            if _numel(shape) > DEDUP_LIMIT:
                if self.weightlike[x] in self.counted:
                    continue  # a big weight read twice (maybe transposed) is one tied weight
                self.counted.add(self.weightlike[x])
            count += _numel(shape)
            nbytes += _numel(shape) * _DTYPE_BYTES.get(elem, 4)
        return count, nbytes


def _add_input_edges(edges, op_type, inputs, key, producer, bytes_of, tensor_bytes) -> None:
    """Edges into ``key`` from the nodes writing its ``inputs`` (``producer``: tensor -> writer's key).

    ``edges`` maps (writer, reader) to the edge's ``bytes`` and ``tensors``.
    """
    for x in inputs:
        u = producer.get(x)
        if u is None:
            continue
        b = 0.0 if op_type in SHAPE_READERS else bytes_of[x]
        tensor_bytes[x] = bytes_of[x]
        data = edges.get((u, key))
        if data is None:
            edges[(u, key)] = {"bytes": b, "tensors": [x]}
        elif x not in data["tensors"]:
            data["tensors"].append(x)
            data["bytes"] += b


def _cost_warnings(unknown: dict[str, int], uncosted: list[str]) -> list[str]:
    out = []
    if unknown:
        listing = ", ".join(f"{t} x{c}" for t, c in sorted(unknown.items()))
        out.append(f"unknown op types costed as bytes only: {listing}")
    if uncosted:
        out.append(f"{len(uncosted)} ops have unknown shapes, FLOPs counted as 0: {', '.join(uncosted[:5])}"
                   + (" ..." if len(uncosted) > 5 else ""))
    return out
