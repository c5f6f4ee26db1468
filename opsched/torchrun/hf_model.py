"""A Hugging Face causal language model split at a plan's stage boundaries, for ``opsched run --hf-config``.

The model is the one ``opsched onnx --hf-config`` exports (the same config,
the same module paths), here built with real weights: random initialisation
from a fixed seed (never a download). Each pipeline stage holds a contiguous
range of the decoder layers named by the plan (``stage_contents[k].modules``,
e.g. ``model.model.layers.0``); the first stage also holds the token embedding,
the last the final norm and the output head, as a chain of stages must. A
tied embedding (``tie_word_embeddings``) is one parameter of the first and the
last stage; the run sums its gradient over the ranks holding it
(:mod:`opsched.torchrun.launch`).

A stage is a shallow copy of the model's own modules that shares their
parameters, so its forward is transformers' own code (the causal mask, the
rotary embedding, the layers) run on fewer layers: the first stage's base
model from token ids, the middle ones from hidden states (``inputs_embeds``),
the last one the full ``...ForCausalLM`` head on top. The single-process
reference runs the unsplit model on each microbatch and accumulates the
gradients as the pipeline does (not the whole batch's loss: transformers
rounds to float32 inside a float64 model, see
:func:`~opsched.torchrun.hf_parts.backward_as_the_pipeline`); the loss is the
cross-entropy on shifted tokens that transformers' ``labels=`` loss computes
(an MoE router's auxiliary loss is left out of both). Dropout and router
noise are off (eval mode; gradients still flow), so both runs compute the same function.

>>> spec = HfModelSpec('{"model_type": "llama"}', ((0, 2), (2, 4)))
>>> spec.num_stages, spec.dtype
(2, 'float64')
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import torch
from torch import nn

from opsched.errors import OpschedError
from opsched.export.plan_layout import layer_split
from opsched.torchrun.hf_clip import ClipSpec, clip_spec_for_plan
from opsched.torchrun.hf_parts import (DEFAULT_RUN_SEQ, RUNTIME, HfStages, LayerSlice, backward_as_the_pipeline,
                                       build_hf_config, shallow_copy)


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

    def split_text(self) -> str:
        """The layers [first, end) per stage, for the run's summary line."""
        return f"layers {list(self.layer_ranges)} per stage"

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
        return model.eval()  # no dropout or router jitter: the pipeline and the reference must agree

    def build_stage_modules(self) -> HfStages:
        """One module per stage, sharing the parameters of one full model (kept as ``.full_model``)."""
        full = self.build_full_model()
        base = full.base_model
        last = self.num_stages - 1
        stages = HfStages(full)
        for k, (first, end) in enumerate(self.layer_ranges):
            part = shallow_copy(base)
            part.layers = LayerSlice({i: base.layers[i] for i in range(first, end)})
            if k > 0:
                part.embed_tokens = None
            if k < last:
                part.norm = nn.Identity()
                stages.append(HfStage(part, k == 0))
            else:
                head = shallow_copy(full)
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

    def reference_step(self, modules: HfStages, x, y, microbatches: int):
        """The unsplit model on each microbatch: the losses, and every stage's gradients of their mean, computed
        as the pipeline computes them (:func:`~opsched.torchrun.hf_parts.backward_as_the_pipeline`: each
        microbatch's loss differentiated alone, the sum divided by M; not the whole batch's loss, which
        transformers' float32 rounding inside the model makes differ by ~1e-7 when M is not a power of two).

        The loss is :meth:`loss_fn`, the definition of transformers' own
        ``labels=`` loss, computed in the model's dtype (transformers' upcasts
        the logits to float32, which would cap a float64 check at float32's precision).
        """
        full = modules.full_model
        losses = backward_as_the_pipeline(full, (self.loss_fn(full(input_ids=xm).logits, ym)
                                                 for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches))),
                                          microbatches)
        grads = {f"{k}.{n}": p.grad.detach().clone() for k, m in enumerate(modules) for n, p in m.named_parameters()}
        return losses, grads


class HfStage(nn.Module):
    """One stage: token ids or hidden states in, hidden states (or, last, logits) out."""

    def __init__(self, inner: nn.Module, takes_ids: bool, head: bool = False):
        super().__init__()
        self.inner, self.takes_ids, self.head = inner, takes_ids, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = {"input_ids": x} if self.takes_ids else {"inputs_embeds": x}
        out = self.inner(**kwargs, use_cache=False)
        return out.logits if self.head else out.last_hidden_state


def hf_spec_for_plan(config_path: str, plan: dict, stages: int, dtype: str = "float64") -> HfModelSpec | ClipSpec:
    """The :class:`HfModelSpec` of ``config_path`` split as ``plan`` (a plan.json document) says, or for CLIP
    the :class:`~opsched.torchrun.hf_clip.ClipSpec`.

    Everything is checked here, before any process starts: the config builds a
    causal language model of the supported shape (or CLIP), and the plan's
    module paths name its layers (see :func:`opsched.export.plan_layout.layer_split`).
    """
    from opsched.model.hf_onnx import _forward_module, _model_kind, read_config_json

    try:
        import transformers  # noqa: F401  (asked here so the message names this command)
    except ImportError:
        raise OpschedError("`opsched run --hf-config` needs transformers: pip install 'opsched[hf]'") from None
    data = read_config_json(config_path)
    config = build_hf_config(data, config_path)
    if _model_kind(config) == "two-tower":
        return clip_spec_for_plan(config_path, data, config, plan, stages, dtype)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = model.base_model
    missing = [name for name in ("embed_tokens", "layers", "norm") if not hasattr(base, name)]
    if missing or not isinstance(base.layers, nn.ModuleList):
        raise OpschedError(f"--hf-config {config_path}: {type(model).__name__} has no {', '.join(missing) or 'layers list'}; "
                           "`opsched run --hf-config` splits models with embed_tokens, layers and norm (Llama, Mixtral, "
                           "Qwen2-MoE style)")
    stack, counts = layer_split(plan, stages, RUNTIME)
    # the plan's module paths are those of the module hf_onnx exported: the model inside its forward wrapper
    wrapper = _forward_module(model, "logits", torch)
    own_stack = next(name for name, module in wrapper.named_modules() if module is base.layers)
    if stack != own_stack or sum(counts) != len(base.layers):
        planned = f"{stack}.0-{sum(counts) - 1}"
        raise OpschedError(f"the plan's stages hold {planned}, but --hf-config {config_path} builds "
                           f"{own_stack}.0-{len(base.layers) - 1}; give the config the plan's ONNX was exported from")
    ends = list(itertools.accumulate(counts))
    ranges = [(end - count, end) for count, end in zip(counts, ends)]
    limit = getattr(config, "max_position_embeddings", None) or DEFAULT_RUN_SEQ
    seq = min(int((plan.get("dims") or {}).get("seq", DEFAULT_RUN_SEQ)), limit)
    return HfModelSpec(json.dumps(data), tuple(ranges), seq=seq, dtype=dtype,
                       model_name=f"{config.model_type} ({type(model).__name__})")
