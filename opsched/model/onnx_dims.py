"""The dimensions of an imported model: named symbolic dims, their values, and a static batch found.

Rule 2 of :mod:`opsched.model.onnx_import`: a graph input's symbolic dims take
their values from ``--dim NAME=VALUE`` (over the model's
``opsched.default_dims`` metadata); a model exported with a static batch has
one found (:func:`static_batch`) and named ``batch``, so it is set like a
symbolic one.
"""

from __future__ import annotations

import ast
import difflib
import re

import onnx

from opsched.errors import OpschedError

DEFAULT_DIMS_KEY = "opsched.default_dims"
DATA_INPUTS_KEY = "opsched.data_inputs"


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


def model_metadata(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}




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


#: the name of the batch dimension: what ``--dim batch=``, ``--micro-batch-size`` and ``--global-batch`` set, and
#: what a static batch axis is called once found (:func:`static_batch`)
BATCH = "batch"


def static_batch(model: onnx.ModelProto, weights: set[str] | frozenset[str] = frozenset()) -> int | None:
    """The batch a model was exported with when it has no symbolic one: the fixed leading size its data inputs share.

    Data inputs are the ``opsched.data_inputs`` metadata's, else every graph
    input that is neither an initializer nor in ``weights``; each must have
    rank 2 or more (a batch of sequences or images, not one sequence) and
    all the same leading size.

    >>> from onnx import TensorProto, helper
    >>> ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 16])
    >>> img = helper.make_tensor_value_info("img", TensorProto.FLOAT, [2, 3, 32, 32])
    >>> out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    >>> static_batch(helper.make_model(helper.make_graph([], "g", [ids, img], [out])))
    2
    >>> ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 16])
    >>> static_batch(helper.make_model(helper.make_graph([], "g", [ids], [out]))) is None
    True
    """
    meta = model_metadata(model)
    init_names = {t.name for t in model.graph.initializer}
    listed = {s.strip() for s in meta.get(DATA_INPUTS_KEY, "").split(",") if s.strip()}
    data = [vi for vi in model.graph.input
            if vi.name not in init_names and vi.name not in weights and (not listed or vi.name in listed)]
    leading = set()
    for vi in data:
        shape = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else []
        if len(shape) < 2 or not shape[0].HasField("dim_value") or shape[0].dim_value <= 0:
            return None
        leading.add(shape[0].dim_value)
    return leading.pop() if len(leading) == 1 else None


def resolve_dims(model: onnx.ModelProto, dims: dict[str, int] | None, warnings: list[str],
                  strict: bool = False) -> dict[str, int]:
    """Defaults from metadata, overridden by ``dims``; error on any unresolved graph-input dim.

    A name in ``dims`` the model does not have is a warning, or with ``strict`` an error naming the ones it has;
    ``batch`` on a model without one is left to :func:`find_static_batch` (a static batch axis may name it).
    """
    meta = model_metadata(model)
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
    known.add(BATCH)  # the model's own, or left to find_static_batch
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


def substitute_dims(model: onnx.ModelProto, dims: dict[str, int]) -> None:
    g = model.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            _set_dims(vi.type.tensor_type, dims, keep_unknown=False)


def symbolic_dim_names(model: onnx.ModelProto) -> set[str]:
    """The names in the graph inputs' symbolic dims (``"2*s0"`` names ``s0``)."""
    exprs = {d.dim_param for vi in model.graph.input for d in vi.type.tensor_type.shape.dim if d.dim_param}
    return {n for expr in exprs for n in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expr)}


def find_static_batch(model, weight_inputs, symbolic: set[str], resolved: dict[str, int],
                       dims: dict[str, int] | None, warnings: list[str], strict: bool) -> int | None:
    """The model's static batch (:func:`static_batch`) when its inputs' ``symbolic`` dims have no ``batch``, with
    ``resolved[batch]`` set (default: as exported) and a warning when rescaled; ``batch`` asked of a model with
    neither is refused (strict) or warned about, as any unknown dim is."""
    if BATCH in symbolic:
        return None
    exported = static_batch(model, weight_inputs)
    if exported is None:
        if BATCH in (dims or {}):
            if strict:
                raise OpschedError(unknown_dim_message(BATCH, symbolic | (set(resolved) - {BATCH})))
            warnings.append(f"dims not used by any graph input: {BATCH}")
        return None
    resolved.setdefault(BATCH, exported)
    if resolved[BATCH] != exported:
        warnings.append(f"the model was exported with a static batch of {exported} (the leading axis of its data "
                        f"inputs): its activations and their operators' FLOPs are scaled to batch {resolved[BATCH]}; "
                        "export with a dynamic batch axis for exact shapes")
    return exported
