"""What the Hugging Face models of ``opsched run --hf-config`` share: the config, stages that share one model's
parameters, layers kept under their own numbers (:mod:`opsched.torchrun.hf_model`, :mod:`opsched.torchrun.hf_clip`).

>>> RUNTIME[0]
'opsched run --hf-config'
"""

from __future__ import annotations

import copy

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


def build_hf_config(data: dict, path: str = "(config)"):
    """The transformers config of a config.json's object (its rules: :mod:`opsched.model.hf_onnx`), for training."""
    from opsched.model.hf_onnx import _build_config, _import_backends

    _torch, transformers = _import_backends()
    config = _build_config(data, path, transformers)
    config._attn_implementation = "sdpa"
    return config
