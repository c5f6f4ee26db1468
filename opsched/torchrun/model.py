"""A tiny mixture-of-experts transformer, split into pipeline stages.

Each block is pre-norm self-attention followed by a pre-norm MoE feed-forward
layer: a router picks the top-k of ``experts`` small MLPs per token and mixes
their outputs with the renormalised router weights. Every expert runs on every
token (a dense mask keeps shapes static), which keeps the model deterministic
and its cost independent of routing. The last stage adds a norm and a linear
head; the loss is the mean squared error against a random target.

The same :class:`ModelSpec` always builds the same parameters, whatever the
split: blocks are created in order from one seed, so a 2-stage and a 4-stage
split of ``blocks=(1, 1, 1, 1)`` / ``(2, 2)`` hold identical weights.

>>> spec = ModelSpec(dim=8, hidden=16, experts=2, heads=2, seq=4, blocks=(1, 2))
>>> [sum(p.numel() for p in m.parameters()) > 0 for m in build_stage_modules(spec)]
[True, True]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of the tiny MoE transformer and how many blocks each stage holds."""

    dim: int = 32
    hidden: int = 64
    experts: int = 4
    top_k: int = 2
    heads: int = 2
    seq: int = 8
    blocks: tuple[int, ...] = (1, 1)
    dtype: str = "float64"
    seed: int = 0

    @property
    def num_stages(self) -> int:
        return len(self.blocks)

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def with_blocks(self, blocks) -> "ModelSpec":
        return ModelSpec(**{**asdict(self), "blocks": tuple(blocks)})

    def to_dict(self) -> dict:
        return asdict(self)

    # what opsched.torchrun.launch asks of a model (opsched.torchrun.hf_model.HfModelSpec answers the same)
    def build_stage_modules(self) -> list["StageModule"]:
        return build_stage_modules(self)

    def batch(self, size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch(self, size, step)

    @staticmethod
    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target)

    def reference_step(self, modules, x, y, microbatches: int):
        return reference_step(modules, x, y, microbatches)


class MoE(nn.Module):
    """Top-k routed mixture of small MLP experts (dense compute, static shapes)."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, dim, hidden) / dim**0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, dim) / hidden**0.5)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.router(x), dim=-1)  # (b, s, e)
        top, idx = weights.topk(self.top_k, dim=-1)
        gate = torch.zeros_like(weights).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        h = torch.relu(torch.einsum("bsd,edh->bseh", x, self.up))
        y = torch.einsum("bseh,ehd->bsed", h, self.down)
        return (y * gate.unsqueeze(-1)).sum(dim=2)


class Block(nn.Module):
    """Pre-norm attention + pre-norm MoE, each with a residual connection."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.norm1 = nn.LayerNorm(spec.dim)
        self.attn = nn.MultiheadAttention(spec.dim, spec.heads, batch_first=True)
        self.norm2 = nn.LayerNorm(spec.dim)
        self.moe = MoE(spec.dim, spec.hidden, spec.experts, spec.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


class StageModule(nn.Module):
    """The blocks of one stage; the last stage also holds the output norm and head."""

    def __init__(self, blocks: list[Block], head: nn.Module | None):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def build_stage_modules(spec: ModelSpec) -> list[StageModule]:
    """The model of ``spec`` as one module per stage, built deterministically from ``spec.seed``."""
    if spec.num_stages < 1 or min(spec.blocks) < 1:
        raise ValueError(f"every stage needs at least one block, got blocks={spec.blocks}")
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(spec.seed)
    try:
        blocks = [Block(spec) for _ in range(sum(spec.blocks))]
        head = nn.Sequential(nn.LayerNorm(spec.dim), nn.Linear(spec.dim, spec.dim))
    finally:
        torch.random.set_rng_state(gen_state)
    modules, start = [], 0
    for k, count in enumerate(spec.blocks):
        last = k == spec.num_stages - 1
        modules.append(StageModule(blocks[start : start + count], head if last else None))
        start += count
    dtype = spec.torch_dtype()
    return [m.to(dtype) for m in modules]


def batch(spec: ModelSpec, size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (input, target) batch of one training step: deterministic in (seed, step)."""
    gen = torch.Generator().manual_seed(1000 * spec.seed + step)
    shape = (size, spec.seq, spec.dim)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(spec.torch_dtype())
    y = torch.randn(shape, generator=gen, dtype=torch.float64).to(spec.torch_dtype())
    return x, y


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error (the per-microbatch loss the pipeline averages)."""
    return torch.nn.functional.mse_loss(output, target)


def reference_step(modules: list[nn.Module], x, y, microbatches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One single-process step: per-microbatch losses and every gradient of their mean.

    This is what a pipeline run with ``scale_grads=True`` must reproduce.
    """
    for m in modules:
        m.zero_grad(set_to_none=True)
    losses = []
    total = 0
    for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
        out = xm
        for m in modules:
            out = m(out)
        loss = loss_fn(out, ym)
        losses.append(float(loss.detach()))
        total = total + loss
    (total / microbatches).backward()
    grads = {f"{k}.{n}": p.grad.detach().clone() for k, m in enumerate(modules) for n, p in m.named_parameters()}
    return losses, grads


def sgd_update(modules: list[nn.Module], lr: float) -> None:
    """Plain SGD on every parameter that has a gradient (the same on every process); a parameter that several
    modules share (a tied embedding) is updated once."""
    with torch.no_grad():
        for p in unique_parameters(modules):
            if p.grad is not None:
                p -= lr * p.grad


def unique_parameters(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of ``modules`` in order, each once, however many of them hold it.

    >>> shared = nn.Linear(2, 2)
    >>> len(unique_parameters([shared, nn.Sequential(shared)]))
    2
    """
    seen: dict[int, nn.Parameter] = {}
    for m in modules:
        for p in m.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())
