"""A Hugging Face causal language model split at a plan's stage boundaries, for ``opsched run --hf-config``.

The model is the one ``opsched onnx --hf-config`` exports (the same config,
the same module paths), here built with real weights: random initialisation
from a fixed seed (never a download). Each pipeline stage holds a contiguous
range of the decoder layers named by the plan (``stage_contents[k].modules``,
e.g. ``model.model.layers.0``); the first stage also holds the token embedding,
the last the final norm and the output head, as a chain of stages must.

A stage is a shallow copy of the model's own modules that shares their
parameters, so its forward is transformers' own code (the causal mask, the
rotary embedding, the layers) run on fewer layers: the first stage's base
model from token ids, the middle ones from hidden states (``inputs_embeds``),
the last one the full ``...ForCausalLM`` head on top. The single-process
reference runs the unsplit model on the whole batch with the model's own loss
(``labels=input_ids``: cross-entropy on shifted tokens).

>>> stage_layer_ranges({0: ["model.model.embed_tokens", "model.model.layers.0", "model.model.layers.1"],
...                     1: ["model.model.layers.2", "model.lm_head"]}, 3, "model.model.layers.")
[(0, 2), (2, 3)]
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

import torch
from torch import nn

from opsched.errors import OpschedError


@dataclass(frozen=True)
class HfModelSpec:
    """The HF model of a config and its split: layers [first, end) per stage; what every rank rebuilds."""

    config_json: str  # the config.json's text (a plain string: the spec crosses process boundaries)
    layer_ranges: tuple[tuple[int, int], ...]
    seq: int = 16
    dtype: str = "float64"
    seed: int = 0
    model_name: str = "the Hugging Face model"

    @property
    def num_stages(self) -> int:
        return len(self.layer_ranges)

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def build_full_model(self) -> nn.Module:
        """The unsplit ``...ForCausalLM`` with weights from ``seed`` (the same on every process)."""
        from transformers import AutoModelForCausalLM

        config = build_hf_config(json.loads(self.config_json))
        state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=self.torch_dtype())
        finally:
            torch.random.set_rng_state(state)
        return model.train()

    def build_stage_modules(self) -> "HfStages":
        """One module per stage, sharing the parameters of one full model (kept as ``.full_model``)."""
        full = self.build_full_model()
        base = full.base_model
        last = self.num_stages - 1
        stages = HfStages(full)
        for k, (first, end) in enumerate(self.layer_ranges):
            part = _shallow(base)
            part.layers = nn.ModuleList(base.layers[i] for i in range(first, end))
            if k > 0:
                part.embed_tokens = None
            if k < last:
                part.norm = nn.Identity()
                stages.append(HfStage(part, k == 0))
            else:
                head = _shallow(full)
                setattr(head, full.base_model_prefix, part)
                stages.append(HfStage(head, k == 0, head=True))
        return stages

    def batch(self, size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random token ids of one step (deterministic in (seed, step)); the target is the same ids."""
        vocab = build_hf_config(json.loads(self.config_json)).vocab_size
        gen = torch.Generator().manual_seed(1000 * self.seed + step)
        ids = torch.randint(0, vocab, (size, self.seq), generator=gen)
        return ids, ids

    @staticmethod
    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of each token's logits against the next token (the mean over a microbatch)."""
        vocab = logits.shape[-1]
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), target[:, 1:].reshape(-1))

    def reference_step(self, modules: "HfStages", x, y, microbatches: int):
        """The unsplit model on the whole batch: per-microbatch losses, every stage's gradients.

        The loss is :meth:`loss_fn`, the definition of transformers' own
        ``labels=`` loss, computed in the model's dtype (transformers' upcasts
        the logits to float32, which would cap a float64 check at float32's precision).
        """
        full = modules.full_model
        full.zero_grad(set_to_none=True)
        with torch.no_grad():
            losses = [float(self.loss_fn(full(input_ids=xm).logits, ym))
                      for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches))]
        # equal-sized microbatches: the whole batch's mean is the mean of their means
        self.loss_fn(full(input_ids=x).logits, y).backward()
        grads = {f"{k}.{n}": p.grad.detach().clone() for k, m in enumerate(modules) for n, p in m.named_parameters()}
        return losses, grads


class HfStages(list):
    """The stage modules, and the full model whose parameters they share (for the reference)."""

    def __init__(self, full_model: nn.Module):
        super().__init__()
        self.full_model = full_model


class HfStage(nn.Module):
    """One stage: token ids or hidden states in, hidden states (or, last, logits) out."""

    def __init__(self, inner: nn.Module, takes_ids: bool, head: bool = False):
        super().__init__()
        self.inner, self.takes_ids, self.head = inner, takes_ids, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = {"input_ids": x} if self.takes_ids else {"inputs_embeds": x}
        out = self.inner(**kwargs, use_cache=False)
        return out.logits if self.head else out.last_hidden_state


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with its own child table: replacing a child leaves the original alone."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin


def hf_spec_for_plan(config_path: str, plan: dict, stages: int, dtype: str = "float64") -> HfModelSpec:
    """The :class:`HfModelSpec` of ``config_path`` split as ``plan`` (a plan.json document) says.

    Everything is checked here, before any process starts: the config builds a
    causal language model of the supported shape, its embedding is not tied to
    the head across stages, and the plan's module paths name its layers (see
    :func:`stage_layer_ranges`).
    """
    from opsched.hf_onnx import _forward_module, _model_kind, read_config_json

    data = read_config_json(config_path)
    config = build_hf_config(data, config_path)
    if _model_kind(config) != "causal-lm":
        raise OpschedError(f"--hf-config {config_path}: {config.model_type} is a two-tower model; `opsched run "
                           "--hf-config` runs causal language models (a chain of decoder layers) so far")
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = model.base_model
    missing = [name for name in ("embed_tokens", "layers", "norm") if not hasattr(base, name)]
    if missing or not isinstance(base.layers, nn.ModuleList):
        raise OpschedError(f"--hf-config {config_path}: {type(model).__name__} has no {', '.join(missing) or 'layers list'}; "
                           "`opsched run --hf-config` splits models with embed_tokens, layers and norm (Llama, Mixtral, "
                           "Qwen2-MoE style)")
    if stages > 1 and getattr(config, "tie_word_embeddings", False):
        raise OpschedError(f"--hf-config {config_path}: tie_word_embeddings is true, so the first and last stages "
                           "would share the embedding; set it to false to run the plan")
    contents = plan.get("stage_contents")
    if not isinstance(contents, dict) or sorted(contents, key=int) != [str(k) for k in range(stages)]:
        raise OpschedError("the plan does not record its stages' module paths (stage_contents); plan the ONNX from "
                           "`opsched onnx --hf-config` again with this opsched")
    wrapper = _forward_module(model, "logits", torch)
    prefix = next(name for name, module in wrapper.named_modules() if module is base.layers) + "."
    ranges = stage_layer_ranges({int(k): list(v.get("modules", [])) for k, v in contents.items()},
                                len(base.layers), prefix)
    limit = getattr(config, "max_position_embeddings", None) or DEFAULT_RUN_SEQ
    seq = min(int((plan.get("dims") or {}).get("seq", DEFAULT_RUN_SEQ)), limit)
    return HfModelSpec(json.dumps(data), tuple(ranges), seq=seq, dtype=dtype,
                       model_name=f"{config.model_type} ({type(model).__name__})")


#: the run's sequence length when the plan does not give one
DEFAULT_RUN_SEQ = 16


def build_hf_config(data: dict, path: str = "(config)"):
    """The transformers config of a config.json's object (its rules: :mod:`opsched.hf_onnx`), for training."""
    from opsched.hf_onnx import _build_config, _import_backends

    _torch, transformers = _import_backends()
    config = _build_config(data, path, transformers)
    config._attn_implementation = "sdpa"
    return config


LAYER_INDEX = re.compile(r"^(?P<prefix>.*\.)(?P<index>\d+)$")


def stage_layer_ranges(modules_of_stage: dict[int, list[str]], num_layers: int,
                       layers_prefix: str) -> list[tuple[int, int]]:
    """Each stage's decoder layers [first, end), from the module paths the plan records for it.

    Paths under ``layers_prefix`` (the model's own layer list, e.g.
    ``model.model.layers.``) name layers; other paths (embedding, norm, head,
    glue) are placed by the chain's rule (first / last stage). Refused with
    :class:`OpschedError` when a path names a layer the model does not have,
    when a layer is split over stages or missing, or when the ranges are not in
    stage order.
    """
    ranges = []
    seen: dict[int, int] = {}
    for sid in sorted(modules_of_stage):
        layers = []
        for path in modules_of_stage[sid]:
            match = LAYER_INDEX.match(path)
            if not match or match["prefix"] != layers_prefix:
                if match and match["prefix"].endswith((".layers.", ".h.", ".layer.", ".blocks.")):
                    raise OpschedError(f"the plan's stage {sid} holds {path}, which this config's model does not "
                                       f"have (its layers are {layers_prefix}0-{num_layers - 1}); give the config "
                                       "the plan was made from")
                continue
            index = int(match["index"])
            if index >= num_layers:
                raise OpschedError(f"the plan's stage {sid} holds {path}, but the config's model has {num_layers} "
                                   "layers; give the config the plan was made from")
            if index in seen:
                raise OpschedError(f"layer {path} is split between stages {seen[index]} and {sid}; `opsched run "
                                   "--hf-config` runs whole layers per stage (plan it with --runtime torch)")
            seen[index] = sid
            layers.append(index)
        if not layers:
            raise OpschedError(f"the plan's stage {sid} holds no decoder layer; `opsched run --hf-config` needs "
                               "at least one layer per stage")
        ranges.append((min(layers), max(layers) + 1))
    expected = 0
    for sid, (first, end) in zip(sorted(modules_of_stage), ranges):
        if first != expected or end - first != sum(1 for s in seen.values() if s == sid):
            raise OpschedError(f"the plan's stages do not hold the layers in order (stage {sid} holds "
                               f"{layers_prefix}{first}-{end - 1}, expected to start at {expected})")
        expected = end
    if expected != num_layers:
        raise OpschedError(f"the plan's stages hold layers 0-{expected - 1}, the config's model has {num_layers}; "
                           "give the config the plan was made from")
    return ranges
