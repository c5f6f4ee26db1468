"""CLIP (an image tower and a text tower) split at a plan's stage boundaries, for ``opsched run --hf-config``.

The model is the one ``opsched onnx --hf-config`` exports from a ``clip``
config (``CLIPModel``: the same module paths), built with random weights from a
fixed seed. A plan of it is a chain of stages, each holding some of the
vision tower's layers (``model.vision_model.encoder.layers.N``), some of the
text tower's (``model.text_model.encoder.layers.N``) or some of both: the
layers of each tower in model order along the chain, whole layers, as
:func:`opsched.export.plan_layout.stack_splits` reads them from the plan.

A pipeline stage passes one tuple on, ``(vision, text, input_ids)``, so the two
towers travel side by side through the chain:

* ``vision``: the image tower's hidden states (the first stage embeds the
  pixel values: patch embedding and pre-norm) through its layers, then the
  image embedding (post-norm of the class token and the visual projection,
  on the stage of its last layer);
* ``text``: the text tower's hidden states (the first stage embeds the token
  ids) through its causal layers, then the text embedding (final norm, the
  end-of-text token's state, the text projection, on the stage of its last
  layer);
* ``input_ids``: the token ids, which the text pooling reads (an integer
  tensor: it carries no gradient).

The last stage holds the similarity head (``logit_scale``) and returns
``logits_per_image``; the loss is CLIP's contrastive loss, transformers' own
``image_text_contrastive_loss`` (what ``CLIPModel(..., return_loss=True)``
computes), over the samples of one microbatch: a pipeline accumulates
microbatch gradients, so each microbatch's images are contrasted with its own
texts, and the reference (transformers' ``CLIPModel`` on one process)
computes the same mean of microbatch losses.

Where the small modules outside the layer stacks run is the run's own rule,
not the plan's: both towers' embeddings on the first stage (as a causal LM's
token embedding), each tower's final norm and projection beside its last
layer, the similarity head on the last stage. A plan may put the second
tower's embedding on a later stage, but torch's split backward (the I and W
passes of zero-bubble orders, ``stage_backward_input``; seen in torch 2.13)
finds a stage's weights by the paths from its inputs that carry gradients:
an embedding looked up from token ids received by a later stage (integers,
no gradient) would get no gradient there. So the first stage holds that
table, and the text tower's hidden states, not its ids, travel until its
layers start.

>>> spec = ClipSpec('{"model_type": "clip"}', {"vision": ((0, 2), (2, 2)), "text": ((0, 0), (0, 2))})
>>> spec.num_stages, spec.pools_on("vision"), spec.pools_on("text")
(2, 0, 1)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import nn

from opsched.errors import OpschedError
from opsched.torchrun.hf_parts import (DEFAULT_RUN_SEQ, RUNTIME, HfStages, LayerSlice, backward_as_the_pipeline,
                                       build_hf_config, shallow_copy)

#: the towers in the order a stage runs them: (name, CLIPModel attribute)
TOWERS = (("vision", "vision_model"), ("text", "text_model"))


@dataclass(frozen=True)
class ClipSpec:
    """A CLIP config and its split: per tower, its layers [first, end) on each stage; what every rank rebuilds."""

    config_json: str
    tower_ranges: dict[str, tuple[tuple[int, int], ...]]  # "vision" / "text" -> per stage
    seq: int = 16
    dtype: str = "float64"
    seed: int = 0
    model_name: str = "clip (CLIPModel)"

    @property
    def num_stages(self) -> int:
        return len(self.tower_ranges["text"])

    def split_text(self) -> str:
        """Each tower's layers [first, end) per stage, for the run's summary line."""
        return ", ".join(f"{tower} layers {list(ranges)}" for tower, ranges in self.tower_ranges.items()) + " per stage"

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def pools_on(self, tower: str) -> int:
        """The stage that turns ``tower``'s hidden states into its embedding: the one holding its last layer."""
        return max((k for k, (first, end) in enumerate(self.tower_ranges[tower]) if end > first), default=0)

    def config(self):
        return build_hf_config(json.loads(self.config_json))

    def build_full_model(self) -> nn.Module:
        """The unsplit ``CLIPModel`` with weights from ``seed`` (the same on every process), in eval mode."""
        from transformers import AutoModel

        state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)
        try:
            model = AutoModel.from_config(self.config(), dtype=self.torch_dtype())
        finally:
            torch.random.set_rng_state(state)
        return model.eval()  # dropout off: the pipeline and the reference compute the same function

    def build_stage_modules(self):
        """One :class:`ClipStage` per stage, sharing the parameters of one full model (kept as ``.full_model``)."""
        full = self.build_full_model()
        stages = HfStages(full)
        for k in range(self.num_stages):
            stages.append(ClipStage(self._stage_part(full, k), k, self))
        return stages

    def _stage_part(self, full: nn.Module, k: int) -> nn.Module:
        """A shallow copy of ``full`` holding only what stage ``k`` runs (so its parameters are the stage's)."""
        part = shallow_copy(full)
        part._parameters = {} if k < self.num_stages - 1 else dict(full._parameters)  # logit_scale: the head's
        for tower, attr in TOWERS:
            inner = shallow_copy(getattr(full, attr))
            encoder = shallow_copy(inner.encoder)
            first, end = self.tower_ranges[tower][k]
            encoder.layers = LayerSlice({i: inner.encoder.layers[i] for i in range(first, end)})
            inner.encoder = encoder
            if k != 0:  # both towers embed on the first stage (the module docstring says why)
                inner.embeddings = None
                if tower == "vision":
                    inner.pre_layrnorm = None
            if k != self.pools_on(tower):
                if tower == "vision":
                    inner.post_layernorm, part.visual_projection = None, None
                else:
                    inner.final_layer_norm, part.text_projection = None, None
            setattr(part, attr, inner)
        return part

    def batch(self, size: int, step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """((pixel values, token ids), target) of one step, deterministic in (seed, step).

        Every text ends in the end-of-text token when the vocabulary has it (a
        tokenizer's output does), so the pooling reads the last position. The
        target is unused: CLIP's labels are each microbatch's own pairing.
        """
        config = self.config()
        vision, text = config.vision_config, config.text_config
        gen = torch.Generator().manual_seed(1000 * self.seed + step)
        pixels = torch.randn((size, vision.num_channels, vision.image_size, vision.image_size), generator=gen,
                             dtype=self.torch_dtype())
        ids = torch.randint(0, text.vocab_size, (size, self.seq), generator=gen)
        eos = text.eos_token_id
        if isinstance(eos, int) and 0 <= eos < text.vocab_size and eos != 2:  # 2: the legacy argmax pooling
            ids[:, -1] = eos
        return (pixels, ids), torch.zeros(size)

    @staticmethod
    def loss_fn(logits_per_image: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """CLIP's contrastive loss of one microbatch (transformers' own function); ``target`` is unused."""
        from transformers.models.clip.modeling_clip import image_text_contrastive_loss

        return image_text_contrastive_loss(logits_per_image.t())

    def reference_step(self, modules, x, y, microbatches: int):
        """transformers' ``CLIPModel`` with ``return_loss=True`` on each microbatch: the losses, and every
        stage's gradients of their mean, accumulated as the pipeline accumulates them
        (:func:`~opsched.torchrun.hf_parts.backward_as_the_pipeline`)."""
        full = modules.full_model
        pixels, ids = x
        pairs = zip(pixels.chunk(microbatches), ids.chunk(microbatches))
        losses = backward_as_the_pipeline(full, (full(input_ids=tokens, pixel_values=px, return_loss=True).loss
                                                 for px, tokens in pairs), microbatches)
        grads = {f"{k}.{n}": p.grad.detach().clone() for k, m in enumerate(modules) for n, p in m.named_parameters()}
        return losses, grads


class ClipStage(nn.Module):
    """One stage of :class:`ClipSpec`: ``(pixel values, token ids)`` or the carried tuple in, the tuple or
    (last) ``logits_per_image`` out."""

    def __init__(self, inner: nn.Module, index: int, spec: ClipSpec):
        super().__init__()
        self.inner = inner
        self.first = index == 0
        self.pools = {tower: spec.pools_on(tower) == index for tower, _ in TOWERS}
        self.last = index == spec.num_stages - 1

    def forward(self, *state: torch.Tensor):
        vision, text, ids = (state[0], state[1], state[1]) if self.first else state
        vision = self._vision(vision)
        text = self._text(text, ids)
        if self.last:
            return self._similarity(vision, text)
        # a fresh tensor each: a stage's received buffer is reused for the next microbatch
        return vision.clone(), text.clone(), ids.clone()

    def _vision(self, x: torch.Tensor) -> torch.Tensor:
        tower = self.inner.vision_model
        if self.first:
            x = tower.pre_layrnorm(tower.embeddings(x))
        for layer in tower.encoder.layers:
            x = layer(x, None)
        if self.pools["vision"]:
            x = self.inner.visual_projection(tower.post_layernorm(x[:, 0, :]))  # the class token's state
        return x

    def _text(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        tower = self.inner.text_model
        if self.first:
            x = tower.embeddings(input_ids=ids)
        if len(tower.encoder.layers):
            mask = create_causal_mask(config=tower.config, inputs_embeds=x, attention_mask=None, cache=None)
            for layer in tower.encoder.layers:
                x = layer(x, mask, is_causal=True)
        if self.pools["text"]:
            x = tower.final_layer_norm(x)
            x = self.inner.text_projection(x[torch.arange(x.shape[0]), _end_of_text(ids, tower.eos_token_id)])
        return x

    def _similarity(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        # transformers' norm (a sum of squares to the power 0.5, not torch.norm), for its rounding
        image = image / image.pow(2).sum(dim=-1, keepdim=True).pow(0.5)
        text = text / text.pow(2).sum(dim=-1, keepdim=True).pow(0.5)
        # transformers' order (text x image, scaled, transposed): the same rounding as CLIPModel's logits_per_image
        return (text @ image.t() * self.inner.logit_scale.exp()).t()


def _end_of_text(ids: torch.Tensor, eos: int | None) -> torch.Tensor:
    """The position CLIP's text tower pools in each sequence: the first end-of-text token (the highest id
    with the legacy ``eos_token_id`` 2); position 0 when there is none.

    >>> _end_of_text(torch.tensor([[5, 9, 3], [9, 1, 9]]), 9).tolist()
    [1, 0]
    >>> _end_of_text(torch.tensor([[5, 9, 3]]), 2).tolist()
    [1]
    """
    if eos == 2:
        return ids.argmax(dim=-1)
    return (ids == eos).int().argmax(dim=-1)


def clip_spec_for_plan(config_path: str, data: dict, config, plan: dict, stages: int, dtype: str) -> ClipSpec:
    """The :class:`ClipSpec` of a CLIP config split as ``plan`` says; :class:`OpschedError` when the plan's
    layer stacks are not the config's towers (see :func:`opsched.export.plan_layout.stack_splits`)."""
    from transformers import AutoModel

    from opsched.export.plan_layout import stack_splits
    from opsched.model.hf_onnx import _forward_module

    if config.model_type != "clip":
        raise OpschedError(f"--hf-config {config_path}: `opsched run --hf-config` runs causal language models and "
                           f"CLIP so far, not {config.model_type}")
    splits = stack_splits(plan, stages, RUNTIME)
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    wrapper = _forward_module(model, "logits_per_image", torch)  # the module hf_onnx exported: its paths
    paths = {module: name for name, module in wrapper.named_modules()}
    stacks = {tower: paths[getattr(model, attr).encoder.layers] for tower, attr in TOWERS}
    own = {stacks[tower]: len(getattr(model, attr).encoder.layers) for tower, attr in TOWERS}
    planned = {stack: sum(map(len, held)) for stack, held in splits.items()}
    if planned != own:
        def held(counts: dict[str, int]) -> str:
            return " and ".join(f"{stack}.0-{n - 1}" for stack, n in counts.items())

        raise OpschedError(f"the plan's stages hold {held(planned)}, but --hf-config {config_path} builds "
                           f"{held(own)}; give the config the plan's ONNX was exported from")
    ranges = {tower: _ranges(splits[stacks[tower]]) for tower, _ in TOWERS}
    limit = config.text_config.max_position_embeddings
    seq = min(int((plan.get("dims") or {}).get("seq", DEFAULT_RUN_SEQ)), limit)
    return ClipSpec(json.dumps(data), ranges, seq=seq, dtype=dtype, model_name=f"clip ({type(model).__name__})")


def _ranges(held: list[list[int]]) -> tuple[tuple[int, int], ...]:
    """Each stage's [first, end) of one tower's layers (whole and in order: checked by ``stack_splits``).

    >>> _ranges([[0, 1], [], [2]])
    ((0, 2), (2, 2), (2, 3))
    """
    out, done = [], 0
    for indices in held:
        first = indices[0] if indices else done
        done = first + len(indices)
        out.append((first, done))
    return tuple(out)
