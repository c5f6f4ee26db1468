"""GraphPipe's multi-modal transformer (MMT) in torch, split along a plan's stage graph, for ``opsched run --mmt-config``.

The model is the one ``models/build.py``'s ``branchy_transformer`` writes as
ONNX (``mmt``, ``branches_kK``), with the same module paths: ``branches.K``
towers of pre-LayerNorm encoder layers (``layers.I`` with ``norm1``,
``self_attn`` (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, biases,
non-causal), ``norm2``, ``mlp`` (``fc1``, exact GELU, ``fc2``)) and a
``final_layernorm``, each reading its own modality's features
``[batch, seq, dim]``; the branches' outputs concatenated along the hidden
axis and ``fusion.proj`` mapping ``K x dim`` back to ``dim``. Its sizes come
from a small JSON config (the sizes ``branchy_transformer`` takes), e.g.::

    {"model_type": "mmt", "branches": 3, "layers": 2, "dim": 16, "heads": 2, "ff": 32, "seq": 8}

Each branch is a tower of :func:`opsched.torchrun.dag_models.tower_splits`:
it reads its modality on its entry stage, runs its layers where the plan
puts them, its final norm on its exit stage; the sink holds the fusion. The
loss (the ONNX model has none) is the mean squared error of the fused output
against a random target. Weights are random from a fixed seed.

>>> spec = MmtSpec(branches=2, layers=1, dim=8, heads=2, ff=16, seq=4, entries=(0, 1), exits=(0, 1),
...                ranges=(((0, 1), (1, 1), (1, 1)), ((0, 0), (0, 1), (1, 1))), routes=((0, 2, ("branch0",)),))
>>> spec.num_stages, sum(p.numel() for p in spec.build_full_model().parameters())
(3, 1368)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from opsched.errors import OpschedError
from opsched.torchrun.dag_models import TowerSplit, edge_routes, load_config, names_on, tower_splits
from opsched.torchrun.hf_parts import HfStages, LayerSlice, backward_as_the_pipeline, shallow_copy

#: the sizes a config gives, all positive integers
SIZES = ("branches", "layers", "dim", "heads", "ff", "seq")


class MmtAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dtype):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim, dtype=dtype) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape

        def split(t):
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        a = nn.functional.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)),
                                                       split(self.v_proj(x)))
        return self.out_proj(a.transpose(1, 2).reshape(b, s, d))


class MmtMlp(nn.Module):
    def __init__(self, dim: int, ff: int, dtype):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, ff, dtype=dtype), nn.Linear(ff, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class MmtLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ff: int, dtype):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, dtype=dtype), nn.LayerNorm(dim, dtype=dtype)
        self.self_attn, self.mlp = MmtAttention(dim, heads, dtype), MmtMlp(dim, ff, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MmtBranch(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, ff: int, dtype):
        super().__init__()
        self.layers = LayerSlice([MmtLayer(dim, heads, ff, dtype) for _ in range(layers)])
        self.final_layernorm = nn.LayerNorm(dim, dtype=dtype)


class Mmt(nn.Module):
    """The whole model: ``forward(*modalities)`` is the fused output."""

    def __init__(self, branches: int, layers: int, dim: int, heads: int, ff: int, dtype):
        super().__init__()
        self.branches = LayerSlice([MmtBranch(layers, dim, heads, ff, dtype) for _ in range(branches)])
        self.fusion = nn.Module()
        self.fusion.proj = nn.Linear(branches * dim, dim, dtype=dtype)

    def forward(self, *modalities: torch.Tensor) -> torch.Tensor:
        outs = []
        for branch, x in zip(self.branches, modalities):
            for layer in branch.layers:
                x = layer(x)
            outs.append(branch.final_layernorm(x))
        return self.fusion.proj(torch.cat(outs, dim=-1))


@dataclass(frozen=True)
class MmtSpec:
    """The MMT's sizes and its split along a DAG plan (per branch: entry, layers per stage, exit; the routes)."""

    branches: int
    layers: int
    dim: int
    heads: int
    ff: int
    seq: int
    entries: tuple[int, ...]
    exits: tuple[int, ...]
    ranges: tuple[tuple[tuple[int, int], ...], ...]  # per branch, per stage
    routes: tuple[tuple[int, int, tuple[str, ...]], ...]
    dtype: str = "float64"
    seed: int = 0

    @property
    def num_stages(self) -> int:
        return len(self.ranges[0])

    @property
    def model_name(self) -> str:
        return f"mmt ({self.branches} branches x {self.layers} layers, width {self.dim})"

    def split_text(self) -> str:
        return ", ".join(f"branch {k} layers {list(r)} per stage" for k, r in enumerate(self.ranges))

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def edge_names(self, src: int, dst: int) -> tuple[str, ...]:
        return names_on(self.routes, src, dst)

    def build_full_model(self) -> Mmt:
        state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)
        try:
            return Mmt(self.branches, self.layers, self.dim, self.heads, self.ff, self.torch_dtype())
        finally:
            torch.random.set_rng_state(state)

    def build_stage_modules(self) -> HfStages:
        """One :class:`MmtStage` per stage, sharing the parameters of one full model (kept as ``.full_model``)."""
        full = self.build_full_model()
        stages = HfStages(full)
        sink = self.num_stages - 1
        for k in range(self.num_stages):
            part = shallow_copy(full)
            held = {}
            for b, branch in enumerate(full.branches):
                split = TowerSplit(self.entries[b], self.ranges[b], self.exits[b])
                if k not in split.path(sink):
                    continue
                copy = shallow_copy(branch)
                first, end = self.ranges[b][k]
                copy.layers = LayerSlice({i: branch.layers[i] for i in range(first, end)})
                copy.final_layernorm = branch.final_layernorm if k == self.exits[b] else None
                held[b] = copy
            part.branches = LayerSlice(held)
            part.fusion = full.fusion if k == sink else None
            stages.append(MmtStage(part, k, self))
        return stages

    def batch(self, size: int, step: int):
        """((one modality's features per branch), target) of one step, deterministic in (seed, step)."""
        gen = torch.Generator().manual_seed(1000 * self.seed + step)
        shape = (size, self.seq, self.dim)
        xs = tuple(torch.randn(shape, generator=gen, dtype=self.torch_dtype()) for _ in range(self.branches))
        return xs, torch.randn(shape, generator=gen, dtype=self.torch_dtype())

    @staticmethod
    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    def reference_step(self, modules: HfStages, x, y, microbatches: int):
        """The unsplit model on each microbatch, each loss differentiated alone, accumulated as the run does."""
        full = modules.full_model
        chunks = list(zip(*(t.chunk(microbatches) for t in x)))
        losses = backward_as_the_pipeline(full, (self.loss_fn(full(*xm), ym)
                                                 for xm, ym in zip(chunks, y.chunk(microbatches))), microbatches)
        grads = {f"{k}.{n}": p.grad.detach().clone() for k, m in enumerate(modules) for n, p in m.named_parameters()}
        return losses, grads


class MmtStage(nn.Module):
    """One stage: ``({"branchK": state}, modalities)`` in, the branches' states (or, on the sink, ``out``) out."""

    def __init__(self, inner: nn.Module, index: int, spec: MmtSpec):
        super().__init__()
        self.inner, self.index = inner, index
        self.entries, self.last = spec.entries, index == spec.num_stages - 1

    def forward(self, received: dict, data) -> dict:
        out = {}
        for name, branch in self.inner.branches.named_children():
            b = int(name)
            x = data[b] if self.entries[b] == self.index else received[f"branch{b}"]
            for layer in branch.layers:
                x = layer(x)
            if branch.final_layernorm is not None:
                x = branch.final_layernorm(x)
            out[f"branch{b}"] = x
        if self.last:
            return {"out": self.inner.fusion.proj(torch.cat([out[f"branch{b}"] for b in range(len(self.entries))],
                                                            dim=-1))}
        return out


def mmt_spec_for_plan(config_path: str, doc: dict, sg, dtype: str = "float64") -> MmtSpec:
    """The :class:`MmtSpec` of an MMT config split as the plan ``doc`` (over stage graph ``sg``) says."""
    config = load_config(config_path)
    sizes = {}
    for key in SIZES:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OpschedError(f"--mmt-config {config_path}: {key} must be a positive integer, got {value!r} "
                               f"(a config gives {', '.join(SIZES)})")
        sizes[key] = value
    if sizes["dim"] % sizes["heads"]:
        raise OpschedError(f"--mmt-config {config_path}: dim {sizes['dim']} is not a multiple of heads {sizes['heads']}")
    towers = {f"branch{b}": (f"branches.{b}", f"branches.{b}.layers") for b in range(sizes["branches"])}
    stacks = set(_stacks(doc, len(sg.stages)))
    own = {stack for _, stack in towers.values()}
    if stacks != own:
        raise OpschedError(f"the plan's stages hold {', '.join(sorted(stacks))}, but --mmt-config {config_path} "
                           f"builds {', '.join(sorted(own))}; give the sizes the plan's ONNX was built with")
    splits = tower_splits(doc, sg, towers)
    counts = {name: sum(end - first for first, end in s.ranges) for name, s in splits.items()}
    if any(n != sizes["layers"] for n in counts.values()):
        raise OpschedError(f"the plan's branches hold {counts} layers, but --mmt-config {config_path} builds "
                           f"{sizes['layers']} a branch; give the sizes the plan's ONNX was built with")
    sink = len(sg.stages) - 1
    ordered = [splits[f"branch{b}"] for b in range(sizes["branches"])]
    return MmtSpec(**sizes, entries=tuple(s.entry for s in ordered), exits=tuple(s.exit for s in ordered),
                   ranges=tuple(s.ranges for s in ordered), routes=edge_routes(splits, sink), dtype=dtype)


def _stacks(doc: dict, stages: int) -> list[str]:
    from opsched.export.plan_layout import stack_splits
    from opsched.torchrun.hf_parts import RUNTIME

    return list(stack_splits(doc, stages, RUNTIME))
