"""A Megatron-style parallel layout: tensor, pipeline (and virtual), expert, context and data-parallel degrees.

The record ``opsched evaluate --layout`` parses, the layout search of ``opsched plan`` enumerates and the
Megatron-LM and torchtitan exports write; it says how devices are cut, not what they cost
(:mod:`opsched.plan.layouts` prices it).

>>> ParallelLayout.parse("tp=2,pp=4,vpp=2,zero=1,recompute=full")
ParallelLayout(tp=2, pp=4, vpp=2, ep=1, etp=0, cp=1, dp=0, sp=False, zero=1, recompute='full', ends_as_layers=False, tp_overlap=False, attention='fused', encoders_first=False)
>>> ParallelLayout.parse("tp=2,pp=4").resolved(16).dp
2
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from opsched.cost.cluster import ATTENTION_MODES, RECOMPUTE_MODES
from opsched.errors import OpschedError

RECOMPUTE = RECOMPUTE_MODES


@dataclass(frozen=True)
class ParallelLayout:
    """A Megatron-style layout: degrees, ZeRO level and recomputation. ``dp = 0`` means derived from the rest.

    ``zero``: 0 none; 1 optimizer states sharded over the data-parallel
    replicas (Megatron's distributed optimizer); 2 gradients too; 3
    parameters too (FSDP's full shard). ``recompute``: ``full`` keeps only
    each layer's input and runs the forward again in the backward;
    ``selective`` runs the attention core's forward again (Korthikanti et
    al. 2022). ``sp``: sequence parallelism, what tensor-parallel ranks
    would hold whole is split along the sequence. ``cp``: context
    parallelism, each microbatch's sequence split over ``cp`` ranks (tp
    innermost, then cp, then dp) that pass keys and values round a ring.
    ``etp``: the tensor-parallel size of the expert layers (Megatron's
    ``expert_tensor_parallel_size``); 0 means ``tp``, Megatron's default.
    ``ends_as_layers``: the embedding and the head count as one layer each
    when the layers are split into chunks (see the module docstring).
    ``tp_overlap``: Megatron's ``--tp-comm-overlap`` (needs tp > 1 and sp):
    each tensor-parallel collective runs under its GEMM
    (:func:`opsched.cost.blocks.tp_comm_overlapped`).
    ``encoders_first``: a model of several stacks of layers (a multimodal LLM's vision encoder and its
    language model) puts every stack but the last (the language model, which the others feed) whole into the
    first pipeline chunk, and splits the last evenly: Megatron-Core's layout for multimodal models (the encoder in the first pipeline stage).
    Without it all the numbered layers, of every stack, are split evenly in model order.
    ``attention``: ``fused`` (FlashAttention and its kin, the default) or
    ``unfused`` (Megatron-LM before FlashAttention: the scores written to
    memory between Q·Kᵀ, softmax, dropout and scores·V;
    :func:`opsched.cost.blocks.unfused_attention_time`).
    The expert grid ``ep x etp`` must divide the ``tp x dp`` devices of a
    pipeline rank (Megatron-Core's parallel folding): with ``etp = tp``
    that is ``ep`` dividing ``dp``; opsched's expert-parallel mode spreads
    the experts over the whole group, ``etp = 1`` and ``ep = tp x dp``.

    >>> ParallelLayout(tp=2, ep=4, etp=1).resolved(4).dp
    2
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 0
    cp: int = 1
    dp: int = 0
    sp: bool = False
    zero: int = 0
    recompute: str = "none"
    ends_as_layers: bool = False
    tp_overlap: bool = False
    attention: str = "fused"
    encoders_first: bool = False

    @classmethod
    def parse(cls, text: str) -> "ParallelLayout":
        """Read ``"tp=1,pp=4,vpp=8,ep=8,zero=1,recompute=selective,sp=1"`` (any order, each key once)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in known:
                raise OpschedError(f"layout item {item!r} is not KEY=VALUE with KEY one of {', '.join(sorted(known))}")
            if key in values:
                raise OpschedError(f"layout sets {key} twice")
            choices = {"recompute": RECOMPUTE, "attention": ATTENTION_MODES}.get(key)
            if choices:
                if value not in choices:
                    raise OpschedError(f"layout {key}={value!r}: choose one of {', '.join(choices)}")
                values[key] = value
                continue
            try:
                number = int(value)
            except ValueError:
                raise OpschedError(f"layout {key}={value!r}: expected a whole number") from None
            if key in ("sp", "ends_as_layers", "tp_overlap", "encoders_first"):
                if number not in (0, 1):
                    raise OpschedError(f"layout {key}={value}: 0 or 1")
                values[key] = bool(number)
            elif key == "zero":
                if number not in (0, 1, 2, 3):
                    raise OpschedError(f"layout zero={value}: 0, 1, 2 or 3")
                values[key] = number
            else:
                least = 0 if key in ("dp", "etp") else 1  # 0: derived (dp) or the same as tp (etp)
                if number < least:
                    raise OpschedError(f"layout {key}={value}: must be at least {least}")
                values[key] = number
        return cls(**values)  # type: ignore[arg-type]

    def resolved(self, devices: int) -> "ParallelLayout":
        """The layout with ``dp`` derived (``devices / (tp·pp·cp)``) and the degrees checked against the devices.

        Needs no model, so the command checks it before the import; :meth:`check_model` does the rest.
        """
        if self.cp > 1 and self.ep > 1:
            raise OpschedError("ep > 1 with cp > 1 is not modelled yet: evaluate one of them at a time")
        per_replica = self.tp * self.pp * self.cp
        dp = self.dp or devices // per_replica
        if per_replica * dp != devices:
            raise OpschedError(f"tp x pp x cp x dp = {self.tp} x {self.pp} x {self.cp} x {dp} = {per_replica * dp}, "
                               f"not the {devices} devices; change a degree or --devices")
        if self.vpp > 1 and self.pp < 2:
            raise OpschedError("vpp > 1 needs pp >= 2")
        if self.tp_overlap and not (self.tp > 1 and self.sp):
            raise OpschedError("tp_overlap=1 needs tp > 1 and sp=1 (Megatron's --tp-comm-overlap runs with sequence "
                               "parallelism only)")
        etp = self.etp or self.tp
        if self.ep > 1 and etp == self.tp and dp % self.ep:
            raise OpschedError(f"ep={self.ep} must divide dp={dp}: expert parallelism is folded over the "
                               "data-parallel replicas")
        if self.ep > 1 and (self.tp * dp) % (self.ep * etp):
            raise OpschedError(f"ep x etp = {self.ep} x {etp} must divide tp x dp = {self.tp} x {dp}: the expert "
                               "layers are laid over the same devices as the others")
        return dataclasses.replace(self, dp=dp)

    @property
    def devices(self) -> int:
        """Devices the (resolved) layout runs on: tp x pp x cp x dp."""
        return self.tp * self.pp * self.cp * self.dp

    def check_model(self, layers: int, experts: int) -> None:
        """Refuse a layout the model cannot take: ep that does not divide its experts, chunks of partial layers."""
        if self.ep > 1:
            if experts == 0:
                raise OpschedError(f"ep={self.ep} but the model has no experts; use ep=1")
            if experts % self.ep:
                raise OpschedError(f"ep={self.ep} does not divide the {experts} experts of an MoE layer")
        units = layers + 2 * self.ends_as_layers
        if units % (self.pp * self.vpp):
            counted = f"{layers} layers + embedding + head" if self.ends_as_layers else f"{layers} layers"
            raise OpschedError(f"pp x vpp = {self.pp} x {self.vpp} does not divide the {counted}; "
                               "Megatron needs whole layers per chunk")

    def __str__(self) -> str:
        text = f"tp{self.tp} pp{self.pp}" + (f" vpp{self.vpp}" if self.vpp > 1 else "") + \
            (f" cp{self.cp}" if self.cp > 1 else "") + \
            (f" ep{self.ep}" if self.ep > 1 else "") + (f" etp{self.etp}" if self.etp else "") + f" dp{self.dp}"
        return text + (" sp" if self.sp else "") + (f" zero{self.zero}" if self.zero else "") + \
            (f" recompute={self.recompute}" if self.recompute != "none" else "") + \
            (" ends-as-layers" if self.ends_as_layers else "") + (" tp-overlap" if self.tp_overlap else "") + \
            (f" attention={self.attention}" if self.attention != "fused" else "") + \
            (" encoders-first" if self.encoders_first else "")
