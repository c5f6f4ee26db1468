"""What an operator's forward keeps for its backward: autograd's saved tensors, by operator type.

A training step stores, per microbatch, the tensors the backward reads, not
every tensor the forward writes. A weight matmul keeps its input (for the
weight gradient), a GeLU its input, a softmax its output, a layer norm its
input; a bias add, a residual add, a reshape or a split keep nothing. Views
(reshape, split, slice, transpose, ...) share their base's storage, so three
views of one fused QKV output cost that output once. Over a GPT layer with
fused attention and no dropout this gives ``32·s·b·h`` bytes (bf16), which is
Korthikanti et al. 2022's ``34·s·b·h`` without its two dropout masks
(docs/cost-model.md, "Stored activations"); counting every output instead
gives ``60·s·b·h``.

The rules follow PyTorch's derivatives (``tools/autograd/derivatives.yaml``):
an operand of a product is kept when the other operand needs a gradient;
an operator none of whose inputs needs a gradient keeps nothing. An operator
type the rules do not know keeps its outputs (the conservative rule).

>>> needs = {"x", "W", "h"}.__contains__
>>> saved_tensors("MatMul", ["x", "W"], ["y"], needs)      # the weight gradient reads x
('x', 'W')
>>> saved_tensors("Add", ["y", "b"], ["z"], needs)
()
>>> saved_tensors("Gelu", ["h"], ["g"], needs), saved_tensors("Softmax", ["h"], ["p"], needs)
(('h',), ('p',))
>>> saved_tensors("Mul", ["h", "scale"], ["m"], needs)    # a constant scale needs no gradient: h is not kept
('scale',)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: operators whose outputs are views of their first input: they share its storage
VIEW_OPS = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Split", "Slice", "Transpose",
                      "Expand"})

#: operators that keep nothing (their backward reads no tensor: sums, moves, casts)
KEEP_NOTHING = frozenset("""
Add Sub Neg Sum Mean Concat Split Slice Reshape Squeeze Unsqueeze Flatten Identity Transpose Expand Tile Pad
Cast CastLike ReduceSum ReduceMean CumSum Shape Size Constant ConstantOfShape Range Equal Less LessOrEqual Greater
GreaterOrEqual Not And Or Xor Floor Ceil Round Sign IsNaN IsInf NonZero ArgMax ArgMin OneHot Trilu EyeLike
GlobalAveragePool AveragePool DepthToSpace SpaceToDepth SplitToSequence ConcatFromSequence
""".split())

#: operators whose outputs never need a gradient (comparisons, indices, shapes)
NO_GRADIENT = frozenset("""
Shape Size Equal Less LessOrEqual Greater GreaterOrEqual Not And Or Xor Floor Ceil Round Sign IsNaN IsInf NonZero
ArgMax ArgMin OneHot Range ConstantOfShape EyeLike
""".split())

#: unary operators whose backward reads their output (PyTorch keeps the result)
KEEP_OUTPUT = frozenset({"Relu", "Sigmoid", "Tanh", "Exp", "Sqrt", "Reciprocal", "Softmax", "LogSoftmax"})

#: unary operators (and norms) whose backward reads their first input
KEEP_INPUT = frozenset("""
LeakyRelu PRelu Elu Selu Celu Gelu HardSigmoid HardSwish Softplus Softsign Mish Swish Erf Sin Cos Tan Asin Acos Atan
Sinh Cosh Asinh Acosh Atanh Log Abs Clip Pow QuickGelu FastGelu BiasGelu ThresholdedRelu Shrink ReduceMax ReduceMin
ReduceL1 ReduceL2 ReduceLogSumExp ReduceProd LpNormalization MeanVarianceNormalization MaxPool GlobalMaxPool
LayerNormalization RMSNormalization SimplifiedLayerNormalization GroupNormalization InstanceNormalization
BatchNormalization SkipLayerNormalization SkipSimplifiedLayerNormalization Resize Upsample
""".split())

#: products: each operand is kept when another operand needs a gradient
PRODUCTS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "FusedMatMul", "Mul"})

#: operators that keep their index input (the gathered or scattered positions), never the data
KEEP_INDICES = frozenset({"Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND", "Scatter"})


def saved_tensors(op_type: str, inputs: Sequence[str], outputs: Sequence[str],
                  needs_gradient: Callable[[str], bool]) -> tuple[str, ...]:
    """The tensors (input or output names) an operator's backward reads, by its type.

    ``needs_gradient(name)`` says whether a tensor needs a gradient (a
    parameter, or computed from one). Empty names (omitted optional inputs)
    are never kept. The caller decides which kept tensors are activations.

    >>> needs = {"q", "k", "v"}.__contains__
    >>> saved_tensors("Attention", ["q", "k", "v"], ["o"], needs)   # fused attention: Q, K, V and its output
    ('q', 'k', 'v', 'o')
    >>> saved_tensors("Gather", ["table", "ids"], ["e"], {"table"}.__contains__)
    ('ids',)
    >>> saved_tensors("Relu", ["mask"], ["r"], needs)                  # nothing here needs a gradient
    ()
    """
    if op_type in KEEP_NOTHING:
        return ()
    present = [x for x in inputs if x]
    if not any(needs_gradient(x) for x in present):
        return ()
    if op_type in PRODUCTS:
        operands = present if op_type == "Einsum" else present[:2]
        return tuple(x for i, x in enumerate(operands)
                     if any(needs_gradient(y) for j, y in enumerate(operands) if j != i))
    if op_type == "Div":  # a / b: the gradient of a reads b; that of b reads a and b
        a, b = (present + ["", ""])[:2]
        kept = ([a] if b and needs_gradient(b) else []) + ([b] if b else [])
        return tuple(x for x in kept if x)
    if op_type == "Attention":
        return (*present[:3], *outputs[:1])
    if op_type in KEEP_OUTPUT:
        return tuple(outputs[:1])
    if op_type in KEEP_INPUT:
        return tuple(present[:1])
    if op_type in ("Max", "Min", "Where"):  # which operand won: the operands, or the condition
        return tuple(present[:1]) if op_type == "Where" else tuple(present)
    if op_type in KEEP_INDICES:
        return tuple(present[1:2])
    if op_type == "TopK":
        return tuple(outputs[1:2])
    if op_type == "Dropout":
        return tuple(o for o in outputs[1:2] if o)  # its mask, when it has one (training mode)
    return tuple(o for o in outputs if o)  # unknown to these rules: keep what it writes
