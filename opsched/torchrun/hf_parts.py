"""What the Hugging Face models of ``opsched run --hf-config`` share: the config, stages that share one model's
parameters, layers kept under their own numbers (:mod:`opsched.torchrun.hf_model`, :mod:`opsched.torchrun.hf_clip`).

>>> RUNTIME[0]
'opsched run --hf-config'
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from opsched.export.framework import Framework

#: this runtime's name in refusals, and what to plan instead of DualPipe's two copies of every stage
RUNTIME = Framework("opsched run --hf-config", "use DualPipeV, which torch runs")

#: the run's sequence length when the plan does not give one
DEFAULT_RUN_SEQ = 16


class HfStages(list):
    """The stage modules, and the full model whose parameters they share (for the reference)."""

    def __init__(self, full_model: nn.Module):
        super().__init__()
        self.full_model = full_model


class LayerSlice(nn.ModuleList):
    """Some of a model's layers under their own numbers, so a stage's parameters keep the model's names.

    Iterating, ``len`` and slicing (what a model's forward does with its
    layers) work as on any ModuleList; indexing by position does not.

    >>> [name for name, _ in LayerSlice({2: nn.Linear(1, 1), 3: nn.Identity()}).named_modules()][1:]
    ['2', '3']
    """

    def __init__(self, layers: dict[int, nn.Module] | list[nn.Module] | None = None):
        super().__init__()
        items = layers.items() if isinstance(layers, dict) else enumerate(layers or [])
        for index, layer in items:
            self.add_module(str(index), layer)


def shallow_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with its own child table: replacing a child leaves the original alone."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin


def backward_as_the_pipeline(model: nn.Module, microbatch_losses: Iterable[torch.Tensor],
                             microbatches: int) -> list[float]:
    """Each microbatch's own loss differentiated alone, its gradients summed, then divided by the microbatch
    count once: the arithmetic of the pipeline run (whose last stage backpropagates each microbatch's loss
    unscaled, :meth:`opsched.torchrun.launch._Runner._finish_gradients` divides after the step); the losses.

    Not the gradient of the whole batch's loss, nor of ``loss / microbatches``, though both are equal in exact
    arithmetic: transformers' models round to float32 inside a float64 model (RMSNorm computes in float32, MoE
    routers take their softmax in float32, DeepSeek-V3's gate its whole matmul), and the backward rounds the
    gradient there too, at a scale (1 / the tokens the loss averages) that differs between the whole batch and a
    microbatch. Scaling by M commutes with that rounding only when M is a power of two: at M = 3, 5 or 6 the
    whole-batch reference differed from the pipeline by ~1e-7 relative. ``microbatch_losses`` may be a generator
    (one microbatch's forward at a time, each backward before the next forward).
    """
    model.zero_grad(set_to_none=True)
    losses = []
    for loss in microbatch_losses:
        loss.backward()
        losses.append(float(loss.detach()))
    for p in model.parameters():  # each parameter once, a tied one too
        if p.grad is not None:
            p.grad.div_(microbatches)
    return losses


def build_hf_config(data: dict, path: str = "(config)"):
    """The transformers config of a config.json's object (its rules: :mod:`opsched.model.hf_onnx`), for training."""
    from opsched.model.hf_onnx import _build_config, _import_backends

    _torch, transformers = _import_backends()
    config = _build_config(data, path, transformers)
    config._attn_implementation = "sdpa"
    return config
