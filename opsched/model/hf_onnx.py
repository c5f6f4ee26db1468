"""A Hugging Face model config -> an ONNX graph opsched can plan, without weights or a download.

For users who have a model's ``config.json`` and no ONNX file. The model is
built by transformers from the config alone, with every **parameter on the
meta device** (shape and dtype, no storage), so a 7B config needs no 28 GB of
memory; buffers (the rotary ``inv_freq``, CLIP's ``position_ids``) are small
and are built on the CPU with the values transformers' own initialisation
gives them, as its ``from_pretrained`` does after a meta-device build. The
model is then exported with ``torch.onnx.export(..., dynamo=True)`` (no
network: nothing is fetched, the config is the only input).

The weights never exist, so they are never written: each parameter becomes an
ONNX initializer with its shape and dtype whose data is marked external, in a
file (:data:`ABSENT_DATA`) that does not exist, the form opsched's importer
reads without loading weights (``onnx.load(..., load_external_data=False)``,
see :mod:`opsched.model.onnx_import`). While the exporter's graph optimiser runs
(constant folding, fusions) the parameters are graph inputs without values, so
it folds nothing from them, as for a model whose weights are all too big to
fold; afterwards they are initializers again.

The graph has symbolic dims ``batch`` and ``seq`` (CLIP-style models: the
text's ``seq``, the image size is fixed by the config); ``--batch`` and
``--seq-len`` become the file's defaults (metadata ``opsched.default_dims``),
which ``opsched plan --dim`` overrides.

Supported models:

* **causal language models**: the configs transformers' ``AutoModelForCausalLM``
  knows (tried: Llama, Mixtral, Qwen2-MoE, DeepSeek-V3, GPT-2);
  input ``input_ids [batch, seq]``, output the logits. MoE experts use
  transformers' ``batched_mm`` implementation (stacked ``[experts, ...]``
  weights read by expert index), whose routed experts the importer counts
  (:mod:`opsched.model.stacked_experts`);
* **two-tower image-text models** (``clip``, ``siglip``): ``input_ids [batch,
  seq]`` and ``pixel_values [batch, 3, image_size, image_size]``, output the
  image-text logits, so both towers and their projections are in the graph.

The parameter count the importer reads is the model's ``sum(p.numel())``
plus the float buffers the graph reads (the rotary ``inv_freq``: head_dim / 2
floats per rotary module; DeepSeek-V3's router score bias), which the file
holds as initializers like weights; tied embeddings are one parameter in both.

>>> read_config_json("no/such/config.json")
Traceback (most recent call last):
...
opsched.errors.OpschedError: --hf-config no/such/config.json: file not found (give the path of a Hugging Face config.json)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from opsched.errors import OpschedError
from opsched.model.onnx_dims import DATA_INPUTS_KEY, DEFAULT_DIMS_KEY
from opsched.model.onnx_ops import NAME_SCOPES_KEY

log = logging.getLogger(__name__)

#: where each initializer's data would be: a file that is never written (import reads shapes only)
ABSENT_DATA = "weights-not-written.data"
#: --dtype -> the torch dtype name the model is built in (weights and activations of the graph)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: model types built as two towers (text, image) by AutoModel, whose forward takes input_ids and pixel_values
TWO_TOWER_TYPES = frozenset({"clip", "siglip"})
#: the traced example sizes of the symbolic dims: 2, not 1 (torch.export fixes a dim whose example is 0 or 1)
EXAMPLE_BATCH, EXAMPLE_SEQ = 2, 8
#: ONNX opset of the export: 23 has Attention and RMSNormalization, so torch's exporter writes SDPA as one
#: Attention op (FLOPs and bytes of a fused kernel, as training runs it) instead of its [batch, heads, seq, seq]
#: score matrices, which would put tens of GiB of activations per layer into the memory model at seq 4096
OPSET = 23
#: --seq-len when not given, unless the model's positions are fewer
DEFAULT_SEQ_LEN = 4096


@dataclass(frozen=True)
class HfExportRequest:
    """What ``opsched onnx --hf-config`` was asked for."""

    config_path: str
    output: str
    seq_len: int | None = None  # None: the model's longest sequence, at most DEFAULT_SEQ_LEN
    batch: int = 1
    dtype: str = "bf16"


@dataclass
class ExampleInputs:
    """The traced inputs of one model kind: names, example tensors, which dims are symbolic, the defaults."""

    names: list[str]
    tensors: tuple
    dynamic: dict[str, dict[int, Any]]
    output: str
    default_dims: dict[str, int] = field(default_factory=dict)


def read_config_json(path: str) -> dict:
    """The config file's JSON object; :class:`OpschedError` for a missing, unreadable or non-object file, or no ``model_type``."""
    shown = f"--hf-config {path}"
    if not os.path.exists(path):
        raise OpschedError(f"{shown}: file not found (give the path of a Hugging Face config.json)")
    if os.path.isdir(path):
        raise OpschedError(f"{shown}: is a directory; give its config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise OpschedError(f"{shown}: cannot read it ({exc.__class__.__name__})") from None
    except json.JSONDecodeError as exc:
        raise OpschedError(f"{shown}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise OpschedError(f"{shown}: expected a JSON object (a model's config.json), got a {type(data).__name__}")
    if not isinstance(data.get("model_type"), str):
        raise OpschedError(f"{shown}: no \"model_type\" key (e.g. \"llama\"); is this a transformers config.json?")
    return data


#: what the export needs, each with the extra that installs it
BACKENDS = {"torch": "torch", "transformers": "hf", "onnxscript": "hf"}


def _import_backends() -> tuple[Any, Any]:
    """``(torch, transformers)``, or :class:`OpschedError` saying how to install what is missing.

    Each is looked up before any is imported (torch alone takes seconds), so a missing one is refused at once.
    """
    import importlib.util

    missing = [name for name in BACKENDS if importlib.util.find_spec(name) is None]
    if missing:
        extras = ",".join(sorted({BACKENDS[name] for name in missing}))
        raise OpschedError(f"opsched onnx --hf-config needs {' and '.join(missing)}: pip install 'opsched[{extras}]'")
    import torch
    import transformers

    return torch, transformers


def _build_config(data: dict, path: str, transformers) -> Any:
    """The transformers config object of ``data``; unknown ``model_type`` or bad values are :class:`OpschedError`."""
    from transformers import CONFIG_MAPPING

    model_type = data["model_type"]
    if model_type not in CONFIG_MAPPING:
        raise OpschedError(f"--hf-config {path}: model_type {model_type!r} is unknown to transformers "
                           f"{transformers.__version__} (check the spelling, or upgrade transformers)")
    # a checkpoint's storage format (e.g. DeepSeek-V3's fp8 blocks) is no part of training in --dtype
    fields = {k: v for k, v in data.items() if k not in ("model_type", "quantization_config")}
    if "quantization_config" in data:
        log.info("hf: the config's quantization_config is left out: the model is built in --dtype")
    try:
        with _transformers_notes():
            config = CONFIG_MAPPING[model_type].from_dict(fields)
    except Exception as exc:  # transformers validates values in many ways; any refusal is the file's
        raise OpschedError(f"--hf-config {path}: transformers refused the config ({_one_line(exc)})") from None
    _check_rotary_dim(config, path)
    config.use_cache = False
    # stacked [experts, ...] weights read by expert index: traceable, and counted by opsched.model.stacked_experts
    config._experts_implementation = "batched_mm"
    return config


def _check_rotary_dim(config, path: str) -> None:
    """Refuse an odd rotary dimension before the export, which would fail deep inside the model's attention.

    Rotary position embeddings turn pairs of channels (``rotate_half`` splits the rotated part in two halves),
    so the rotated part of a head must have an even size. transformers checks an explicit ``head_dim`` when it
    builds the config, not one derived from ``hidden_size / num_attention_heads``.
    """
    rope = getattr(config, "rope_parameters", None)
    if not rope:  # learned or no positions (gpt2, clip)
        return
    heads = getattr(config, "num_attention_heads", None)
    head = getattr(config, "qk_rope_head_dim", None) or getattr(config, "head_dim", None)
    shown = "qk_rope_head_dim" if getattr(config, "qk_rope_head_dim", None) else "head_dim"
    if not head and heads:
        head, shown = config.hidden_size // heads, f"head dim (hidden_size {config.hidden_size} / num_attention_heads {heads})"
    if not head:
        return
    rotary = int(head * rope.get("partial_rotary_factor", 1.0))
    if rotary % 2:
        raise OpschedError(f"--hf-config {path}: {shown} gives a rotary dimension of {rotary}, which is odd; rotary "
                           "position embeddings rotate pairs of channels, so make it even (e.g. another "
                           "num_attention_heads or hidden_size)")


def _model_kind(config) -> str:
    """``"causal-lm"`` or ``"two-tower"`` (see the module docstring); :class:`OpschedError` for other models."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type in TWO_TOWER_TYPES:
        return "two-tower"
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal-lm"
    raise OpschedError(f"model_type {config.model_type!r} is not supported by opsched onnx --hf-config yet: it exports "
                       f"causal language models and the two-tower types {', '.join(sorted(TWO_TOWER_TYPES))}; "
                       "export other models with torch.onnx.export yourself (any of its files plans, weights or not)")


def _build_empty_model(config, kind: str, dtype: str, torch) -> Any:
    """The model with its parameters on the meta device (no storage) and its buffers real, on the CPU.

    Buffers are made again on the CPU and filled by the model's own
    ``_init_weights``, as transformers does after building on the meta device;
    except a float buffer of a module with weights of its own (DeepSeek-V3's
    router score bias), which meets those weights in an op that takes one
    device: it stays on meta, an initializer like a weight in the file.
    """
    from transformers import AutoModel, AutoModelForCausalLM

    auto = AutoModelForCausalLM if kind == "causal-lm" else AutoModel
    try:
        with torch.device("meta"):
            model = auto.from_config(config, dtype=getattr(torch, DTYPES[dtype]))
    except Exception as exc:
        raise OpschedError(f"transformers cannot build {config.model_type} from this config ({_one_line(exc)})") from None
    owners = {}
    for name, buffer in list(model.named_buffers()):
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if buffer.is_floating_point() and next(module.parameters(recurse=False), None) is not None:
            continue
        module._buffers[leaf] = torch.empty_like(buffer, device="cpu")
        owners[module_name] = module
    for module in owners.values():
        model._init_weights(module)  # on meta parameters a no-op; on the buffers, their values
    return model.eval()


def _example_inputs(config, kind: str, request: HfExportRequest, torch) -> ExampleInputs:
    """The traced inputs of ``kind`` and the file's default dims (``--batch``, ``--seq-len`` or the model's limit)."""
    text = config.text_config if kind == "two-tower" else config
    limit = getattr(text, "max_position_embeddings", None) or DEFAULT_SEQ_LEN
    seq = request.seq_len or min(limit, DEFAULT_SEQ_LEN)
    if seq > limit:
        raise OpschedError(f"--seq-len {seq} is over the model's {limit:,} positions (max_position_embeddings); "
                           f"give at most {limit:,}")
    batch_dim = torch.export.Dim("batch")
    seq_dim = torch.export.Dim("seq", max=limit) if kind == "two-tower" else torch.export.Dim("seq")
    example_seq = min(EXAMPLE_SEQ, limit)
    ids = torch.zeros((EXAMPLE_BATCH, example_seq), dtype=torch.long)
    dims = {"batch": request.batch, "seq": seq}
    if kind == "causal-lm":
        return ExampleInputs(["input_ids"], (ids,), {"input_ids": {0: batch_dim, 1: seq_dim}}, "logits", dims)
    vision = config.vision_config
    # on the meta device like the weights it meets first (a convolution takes no mix of devices); the
    # token ids may stay on the CPU: an embedding lookup reads a meta weight at CPU indices
    pixels = torch.zeros((EXAMPLE_BATCH, vision.num_channels, vision.image_size, vision.image_size),
                         dtype=getattr(torch, DTYPES[request.dtype]), device="meta")
    return ExampleInputs(["input_ids", "pixel_values"], (ids, pixels),
                         {"input_ids": {0: batch_dim, 1: seq_dim}, "pixel_values": {0: batch_dim}},
                         "logits_per_image", dims)


def _forward_module(model, output: str, torch):
    """The model as a module of tensors returning one tensor (``output`` of its result), for torch.export."""

    class TextForward(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.model = inner

        def forward(self, input_ids):
            return getattr(self.model(input_ids=input_ids), output)

    class TextImageForward(TextForward):
        def forward(self, input_ids, pixel_values):
            return getattr(self.model(input_ids=input_ids, pixel_values=pixel_values), output)

    return (TextForward if output == "logits" else TextImageForward)(model).eval()


def _export_empty(model, inputs: ExampleInputs, torch):
    """The ``onnx.ModelProto`` of ``model`` (meta parameters) with each parameter an initializer whose data is absent."""
    started = time.monotonic()
    try:
        with _exporter_quiet():
            program = torch.onnx.export(_forward_module(model, inputs.output, torch), inputs.tensors, dynamo=True,
                                        dynamic_shapes=inputs.dynamic, input_names=inputs.names,
                                        output_names=[inputs.output], optimize=False, verbose=False,
                                        opset_version=OPSET)
    except Exception as exc:
        raise OpschedError(f"torch.onnx.export could not export this model ({_one_line(exc)})") from None
    log.info("hf: traced the model in %.1f s: %d ONNX nodes before optimising", time.monotonic() - started,
             len(program.model.graph))
    weights = _detach_weights(program.model.graph)
    with _exporter_quiet():
        program.optimize()
    _attach_absent_weights(program.model.graph, weights)
    import onnx_ir as ir

    proto = ir.serde.serialize_model(program.model)
    _keep_name_scopes(proto)
    log.info("hf: exported in %.1f s: %d nodes, %d weights", time.monotonic() - started, len(proto.graph.node),
             len(weights))
    return proto


@dataclass(frozen=True)
class _Weight:
    """A parameter initializer taken out of the graph while the optimiser runs."""

    value: Any  # the onnx_ir.Value
    dtype: Any
    shape: Any
    nbytes: int


def _detach_weights(graph) -> list[_Weight]:
    """Make every meta-device initializer a graph input without a value, so the optimiser never reads it."""
    weights = []
    for value in list(graph.initializers.values()):
        tensor = getattr(value.const_value, "raw", None)
        if getattr(getattr(tensor, "device", None), "type", None) != "meta":
            continue  # a real buffer: the optimiser may fold it
        weights.append(_Weight(value, value.const_value.dtype, value.const_value.shape,
                               tensor.numel() * tensor.element_size()))
        graph.initializers.pop(value.name)
        value.const_value = None
        graph.inputs.append(value)
    return weights


def _attach_absent_weights(graph, weights: list[_Weight]) -> None:
    """Put the weights back as initializers whose data lies in :data:`ABSENT_DATA` (never written)."""
    import onnx_ir as ir

    still_used = [w for w in weights if w.value in graph.inputs]
    for w in still_used:
        graph.inputs.remove(w.value)
        w.value.const_value = ir.ExternalTensor(ABSENT_DATA, offset=0, length=w.nbytes, dtype=w.dtype, shape=w.shape,
                                                name=w.value.name)
        graph.register_initializer(w.value)


def _keep_name_scopes(proto) -> None:
    """Drop the exporter's per-node stack traces and class names (most of the file); keep the module scopes."""
    for node in proto.graph.node:
        scopes = [(p.key, p.value) for p in node.metadata_props if p.key == NAME_SCOPES_KEY]
        del node.metadata_props[:]
        for key, value in scopes:
            entry = node.metadata_props.add()
            entry.key, entry.value = key, value


class _ToLog(logging.Handler):
    """Passes a record on to opsched's log at DEBUG (below the CLI's INFO; a caller's own logging may show it)."""

    def emit(self, record: logging.LogRecord) -> None:
        log.debug("hf: transformers says: %s", record.getMessage())


@contextlib.contextmanager
def _transformers_notes() -> Iterator[None]:
    """transformers' warnings on a config (a token id outside a small vocabulary, ...) as DEBUG lines of opsched's log:
    they say nothing about the cost of training, and a bad-input refusal must stay one line on stderr."""
    hf_log = logging.getLogger("transformers")
    handlers, propagate = hf_log.handlers[:], hf_log.propagate
    hf_log.handlers, hf_log.propagate = [_ToLog()], False
    try:
        yield
    finally:
        hf_log.handlers, hf_log.propagate = handlers, propagate


@contextlib.contextmanager
def _exporter_quiet() -> Iterator[None]:
    """Hide the exporter's own notices (absent torchvision ops, deprecations): opsched's log says what happens."""
    torch_log = logging.getLogger("torch.onnx")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch_log.setLevel(level)


def _one_line(exc: BaseException) -> str:
    """The first line of the innermost cause of ``exc`` (torch wraps the reason in steps of its own)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def export_hf_config(request: HfExportRequest) -> Path:
    """Build the model of ``request.config_path`` without weights and write its ONNX graph to ``request.output``.

    Every input is checked before the export; the file is written whole or not at all.

    >>> export_hf_config(HfExportRequest("llama/config.json", "llama.onnx", seq_len=4096))  # doctest: +SKIP
    PosixPath('llama.onnx')
    """
    import onnx

    from opsched.fileio import check_output_file, write_bytes

    data = read_config_json(request.config_path)
    parent = Path(request.output).parent
    if not parent.exists():  # unlike a plan's directory, not made: a mistyped path would be hard to find
        raise OpschedError(f"-o {request.output}: directory {parent} does not exist (create it first)")
    check_output_file(request.output, "-o", example="model.onnx")
    torch, transformers = _import_backends()
    config = _build_config(data, request.config_path, transformers)
    kind = _model_kind(config)
    inputs = _example_inputs(config, kind, request, torch)
    log.info("hf: building %s (%s) from %s with parameters on the meta device", type(config).__name__, kind,
             request.config_path)
    model = _build_empty_model(config, kind, request.dtype, torch)
    params = sum(p.numel() for p in model.parameters())
    log.info("hf: %s parameters, none allocated", f"{params:,}")
    proto = _export_empty(model, inputs, torch)
    onnx.helper.set_model_props(proto, {
        DEFAULT_DIMS_KEY: ",".join(f"{k}={v}" for k, v in inputs.default_dims.items()),
        DATA_INPUTS_KEY: ",".join(inputs.names),
        "opsched.hf_config.model_type": config.model_type,
        "opsched.hf_config.parameters": str(params),
    })
    return write_bytes(request.output, proto.SerializeToString())
