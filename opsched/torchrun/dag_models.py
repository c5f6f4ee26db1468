"""Models split along a plan's stage *graph* (a DAG), for :mod:`opsched.torchrun.dag_runtime`.

A branching plan puts each *tower* of a model (CLIP's image and text
encoders, a branch of GraphPipe's multi-modal transformer) on its own stages,
possibly on other device groups than its sibling's, and joins them on a later
stage. :func:`tower_splits` reads, per tower, where it runs from plan.json's
``stage_contents``:

* its *entry*: the first stage (in topological order) holding any of the
  tower's modules: it embeds (or reads) the tower's input from the data;
* its layers per stage (whole layers, in model order:
  :func:`opsched.export.plan_layout.stack_splits`);
* its *exit*: the last stage holding any of its modules: its final norm and
  projection run there;

and the tower's state travels entry -> the stages of its layers -> exit ->
the sink (the last stage, which joins the towers and computes the loss),
each hop along an edge of the plan's stage graph: a hop without an edge is
refused. An edge carries the states of the towers that hop along it (CLIP's
edge of a stage feeding both towers carries both); an edge no tower hops
along carries nothing here (in the ONNX graph it carries shapes or token
ids, which every stage reads from the data).

:class:`GraphMlpSpec` is the synthetic stand-in for any stage graph (a plan
run without a model config), and the executor's test model: stage k applies
``tanh(linear(sum of its inputs))``, a source stage reads the data, a stage
feeding several sends the same tensor to each (the executor sums their
gradients), the sink's output meets a random target in a squared error.

>>> spec = GraphMlpSpec(((0, 1), (0, 2), (1, 3), (2, 3)), 4, dim=4)
>>> spec.edge_names(0, 2), spec.sources()
(('s0',), (0,))
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import nn

from opsched.errors import OpschedError
from opsched.torchrun.hf_clip import TOWERS, ClipSpec, ClipStage
from opsched.torchrun.hf_parts import RUNTIME, HfStages, backward_as_the_pipeline


@dataclass(frozen=True)
class TowerSplit:
    """Where one tower runs in a DAG plan: entry stage, layers [first, end) per stage, exit stage."""

    entry: int
    ranges: tuple[tuple[int, int], ...]
    exit: int

    def path(self, sink: int) -> list[int]:
        """The stages the tower's state visits, in order: entry, its layers' stages, exit, the sink.

        >>> TowerSplit(0, ((0, 0), (0, 2), (2, 2), (2, 2)), 2).path(3)
        [0, 1, 2, 3]
        """
        stages = [self.entry] + [k for k, (first, end) in enumerate(self.ranges) if end > first]
        out: list[int] = []
        for k in stages + [self.exit, sink]:
            if not out or out[-1] != k:
                out.append(k)
        return out


def tower_splits(doc: dict, sg, towers: dict[str, tuple[str, str]]) -> dict[str, TowerSplit]:
    """Each tower's :class:`TowerSplit` in the plan ``doc`` over stage graph ``sg``; ``towers``: name ->
    (the tower's module path, the path of its layer stack). :class:`OpschedError` when a tower's state would
    hop between two stages no edge joins, or its layers are not the plan's."""
    from opsched.export.plan_layout import stack_splits

    n = len(sg.stages)
    splits = stack_splits(doc, n, RUNTIME)
    position = {sid: i for i, sid in enumerate(sg.topological_order())}
    edges = {(e.src, e.dst) for e in sg.edges}
    out = {}
    for name, (prefix, stack) in towers.items():
        held = [k for k in range(n) if any(p == prefix or p.startswith(prefix + ".")
                                            for p in doc["stage_contents"][str(k)]["modules"])]
        if stack not in splits or not held:
            raise OpschedError(f"the plan's stages hold no {stack}.N; give the config the plan was made from")
        ends = [0]
        for indices in splits[stack]:
            ends.append(ends[-1] + len(indices))
        held.sort(key=position.__getitem__)
        split = TowerSplit(held[0], tuple(zip(ends[:-1], ends[1:])), held[-1])
        path = split.path(n - 1)
        for src, dst in zip(path, path[1:]):
            if (src, dst) not in edges:
                raise OpschedError(f"{name}'s state goes from stage {src} to stage {dst} (the stages of "
                                   f"its parts: {path}), but the plan's stage graph has no edge {src} -> {dst}")
        out[name] = split
    return out


def edge_routes(splits: dict[str, TowerSplit], sink: int) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    """(src, dst, the towers whose state hops along that edge), for every edge some tower uses."""
    routes: dict[tuple[int, int], list[str]] = {}
    for name, split in splits.items():
        path = split.path(sink)
        for hop in zip(path, path[1:]):
            routes.setdefault(hop, []).append(name)
    return tuple((src, dst, tuple(names)) for (src, dst), names in sorted(routes.items()))


def names_on(routes, src: int, dst: int) -> tuple[str, ...]:
    return next((names for s, d, names in routes if (s, d) == (src, dst)), ())


# --------------------------------------------------------------------------- CLIP


@dataclass(frozen=True)
class ClipDagSpec(ClipSpec):
    """CLIP split along a DAG plan: each tower embeds on its entry stage, pools on its exit stage, the sink holds
    the similarity head (``logit_scale``). ``tower_ranges`` as :class:`ClipSpec`'s; the rest from
    :func:`tower_splits`."""

    entries: tuple[tuple[str, int], ...] = ()
    exits: tuple[tuple[str, int], ...] = ()
    routes: tuple[tuple[int, int, tuple[str, ...]], ...] = ()

    def pools_on(self, tower: str) -> int:
        return dict(self.exits)[tower]

    def split_text(self) -> str:
        entries, exits = dict(self.entries), dict(self.exits)
        return ", ".join(f"{tower} embedded on stage {entries[tower]}, layers {list(ranges)} per stage, pooled on "
                         f"stage {exits[tower]}" for tower, ranges in self.tower_ranges.items())

    def edge_names(self, src: int, dst: int) -> tuple[str, ...]:
        return names_on(self.routes, src, dst)

    def build_stage_modules(self):
        full = self.build_full_model()
        stages = HfStages(full)
        for k in range(self.num_stages):
            stages.append(ClipDagStage(self._stage_part(full, k), k, self))
        return stages

    def _stage_part(self, full: nn.Module, k: int) -> nn.Module:
        part = super()._stage_part(full, k)
        for tower, attr in TOWERS:  # the embedding on the tower's entry (ClipSpec: on stage 0)
            inner = getattr(part, attr)
            if k == dict(self.entries)[tower]:
                original = getattr(full, attr)
                inner.embeddings = original.embeddings
                if tower == "vision":
                    inner.pre_layrnorm = original.pre_layrnorm
            elif k == 0:
                inner.embeddings = None
                if tower == "vision":
                    inner.pre_layrnorm = None
        return part


class ClipDagStage(ClipStage):
    """One stage of :class:`ClipDagSpec`: ``({tower: state}, (pixel values, token ids))`` in, ``{tower: state}``
    (or, on the sink, ``{"out": logits_per_image}``) out."""

    def __init__(self, inner: nn.Module, index: int, spec: ClipDagSpec):
        super().__init__(inner, index, spec)
        self.index, self.entries = index, dict(spec.entries)
        exits, sink = dict(spec.exits), spec.num_stages - 1
        self.holds = {tower: index in TowerSplit(self.entries[tower], spec.tower_ranges[tower], exits[tower]).path(sink)
                      for tower, _ in TOWERS}

    def forward(self, received: dict, data) -> dict:
        pixels, ids = data
        out = {}
        for tower, _ in TOWERS:
            if not self.holds[tower]:
                continue
            self.first = self.entries[tower] == self.index  # ClipStage embeds a tower when ``first``
            source = (pixels if tower == "vision" else ids) if self.first else received[tower]
            out[tower] = self._vision(source) if tower == "vision" else self._text(source, ids)
        if self.last:
            return {"out": self._similarity(out["vision"], out["text"])}
        return out


def clip_dag_spec(spec: ClipSpec, doc: dict, sg) -> ClipDagSpec:
    """The :class:`ClipDagSpec` of a CLIP plan whose stage graph branches (``spec``: its chain reading)."""
    towers = {tower: (f"model.{attr}", f"model.{attr}.encoder.layers") for tower, attr in TOWERS}
    splits = tower_splits(doc, sg, towers)
    return ClipDagSpec(spec.config_json, {t: s.ranges for t, s in splits.items()}, seq=spec.seq, dtype=spec.dtype,
                       seed=spec.seed, model_name=spec.model_name,
                       entries=tuple((t, s.entry) for t, s in splits.items()),
                       exits=tuple((t, s.exit) for t, s in splits.items()),
                       routes=edge_routes(splits, len(sg.stages) - 1))


def dag_spec_for_plan(doc: dict, sg, hf_config: str | None, mmt_config: str | None, dim: int = 16,
                      dtype: str = "float64"):
    """The DAG spec ``opsched run`` runs a plan with: CLIP (``hf_config``), the MMT (``mmt_config``) or, with
    neither, :class:`GraphMlpSpec` of width ``dim``."""
    if hf_config:
        from opsched.torchrun.hf_model import hf_spec_for_plan

        spec = hf_spec_for_plan(hf_config, doc, len(sg.stages), dtype)
        if not isinstance(spec, ClipSpec):
            raise OpschedError(f"the plan's stage graph branches, but --hf-config {hf_config} is a causal language "
                               "model, one stack of layers: plan it as a chain (`opsched plan --branches off`)")
        return clip_dag_spec(spec, doc, sg)
    if mmt_config:
        from opsched.torchrun.mmt import mmt_spec_for_plan

        return mmt_spec_for_plan(mmt_config, doc, sg, dtype)
    return GraphMlpSpec(tuple((e.src, e.dst) for e in sg.edges), len(sg.stages), dim=dim, dtype=dtype)


# --------------------------------------------------------------------------- a stand-in for any stage graph


@dataclass(frozen=True)
class GraphMlpSpec:
    """A tiny MLP per stage wired as the stage graph ``edges``: the synthetic stand-in of a DAG plan."""

    edges: tuple[tuple[int, int], ...]
    num_stages: int
    dim: int = 16
    seq: int = 4
    dtype: str = "float64"
    seed: int = 0
    model_name: str = "the synthetic stand-in (an MLP per stage, wired as the stage graph)"

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def sources(self) -> tuple[int, ...]:
        return tuple(k for k in range(self.num_stages) if all(dst != k for _, dst in self.edges))

    def edge_names(self, src: int, dst: int) -> tuple[str, ...]:
        return (f"s{src}",)

    def split_text(self) -> str:
        return f"{self.num_stages} stages of width {self.dim}"

    def build_stage_modules(self) -> HfStages:
        gen = torch.Generator().manual_seed(self.seed)
        stages = HfStages(nn.Module())
        for k in range(self.num_stages):
            stage = GraphMlpStage(k, k in self.sources(), self.dim, self.torch_dtype(), gen)
            stages.append(stage)
            stages.full_model.add_module(str(k), stage)
        return stages

    def batch(self, size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * self.seed + step + 1)
        shape = (size, self.seq, self.dim)
        return (torch.randn(shape, generator=gen, dtype=self.torch_dtype()),
                torch.randn(shape, generator=gen, dtype=self.torch_dtype()))

    @staticmethod
    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    def reference_step(self, modules: HfStages, x, y, microbatches: int):
        """Every stage in one process, no cut between them, each microbatch's loss differentiated alone."""
        def losses():
            for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
                outs: dict[int, torch.Tensor] = {}
                for k in range(self.num_stages):
                    received = {f"s{src}": outs[src] for src, dst in self.edges if dst == k}
                    outs[k] = modules[k](received, xm)["out"]
                yield self.loss_fn(outs[self.num_stages - 1], ym)

        result = backward_as_the_pipeline(modules.full_model, losses(), microbatches)
        grads = {f"{k}.{n}": p.grad.detach().clone() for k, m in enumerate(modules) for n, p in m.named_parameters()}
        return result, grads


class GraphMlpStage(nn.Module):
    """``tanh(linear(sum of the inputs))``; a source stage's input is the data. Returns its output under its own
    name (what its edges carry) and as ``out``."""

    def __init__(self, index: int, source: bool, dim: int, dtype: torch.dtype, gen: torch.Generator):
        super().__init__()
        self.index, self.source = index, source
        self.linear = nn.Linear(dim, dim, dtype=dtype)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(dim, dim, generator=gen, dtype=dtype) / dim ** 0.5)
            self.linear.bias.copy_(torch.randn(dim, generator=gen, dtype=dtype) / 10)

    def forward(self, received: dict, data) -> dict:
        x = data if self.source else sum(received[k] for k in sorted(received))
        h = torch.tanh(self.linear(x))
        return {f"s{self.index}": h, "out": h}


def load_config(path: str) -> dict:
    """A JSON config file as a dict; :class:`OpschedError` (one line) when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise OpschedError(f"{path}: file not found") from None
    except (OSError, ValueError) as exc:
        raise OpschedError(f"{path}: not a JSON object ({exc})") from None
    if not isinstance(data, dict):
        raise OpschedError(f"{path}: not a JSON object")
    return data
