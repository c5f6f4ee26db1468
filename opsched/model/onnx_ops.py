"""The ONNX operator tables and forward-FLOP rules of the importer (:mod:`opsched.model.onnx_import`).

Bytes per element of each ONNX data type, the families of operators the cost
rules tell apart (data movement, elementwise, reductions, pooling, norms,
matmuls), and :func:`op_flops`, the forward FLOPs of one node from its
input and output shapes (the formulas are in :mod:`opsched.model.onnx_import`'s
docstring). Holds no graph state: the importer and the graph builder
(:mod:`opsched.model.onnx_build`) both read it.
"""

from __future__ import annotations

import dataclasses

import onnx
from onnx import TensorProto

from opsched.model.gemm import GemmShape, padded_flops

#: the node metadata key a dynamo export writes its module scopes under (node_scope, and which exporter wrote a model)
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


def _static(shape) -> bool:
    return shape is not None and None not in shape


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


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
    heads: int = 0  # query heads
    kv_heads: int = 0  # key-value heads (fewer than ``heads`` under grouped-query attention)

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
        skv, dv, hkv = k[2], v[3], k[1]
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
    return _AttentionDims(batch_heads=b * h, sq=sq, skv=skv, dqk=dqk, dv=dv, heads=h, kv_heads=hkv)


#: ops that run as matrix multiplies on tensor cores (their FLOPs and bytes are costed apart, cost.compute_time)
MATMUL_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "MatMulInteger", "FusedMatMul",
                        "ConvInteger"})

# Op types op_flops knows how to cost: None for one of these means its shapes are unknown.
_COSTED_OPS = (ELEMENTWISE_OPS | frozenset(PER_ELEMENT) | REDUCE_OPS | REDUCE2_OPS | POOL_OPS | GLOBAL_POOL_OPS
               | {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention", "MatMulInteger", "FusedMatMul",
                  "ConvInteger"})
