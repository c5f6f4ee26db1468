"""A Megatron-style parallel layout: tensor, pipeline (and virtual), expert, context and data-parallel degrees.

The record ``opsched evaluate --layout`` parses, the layout search of ``opsched plan`` enumerates and the
Megatron-LM and torchtitan exports write; it says how devices are cut, not what they cost
(:mod:`opsched.plan.layouts` prices it).

>>> ParallelLayout.parse("tp=2,pp=4,vpp=2,zero=1,recompute=full")
ParallelLayout(tp=2, pp=4, vpp=2, ep=1, etp=0, cp=1, dp=0, sp=False, zero=1, recompute='full', ends_as_layers=False, tp_overlap=False, attention='fused', pipeline_layout='', first_layers=0, last_layers=0, max_nodes=0, recompute_modules='', encoders_first=False)
>>> ParallelLayout.parse("tp=2,pp=4").resolved(16).dp
2
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from opsched.cost.cluster import ATTENTION_MODES, RECOMPUTE_MODES, ZERO_LEVELS
from opsched.cost.pipeline_split import chunk_units, compact_pipeline_layout, expand_pipeline_layout
from opsched.errors import OpschedError
from opsched.model.recompute_modules import RECOMPUTE_MODULES

#: keys whose value is a list that may hold commas (Megatron writes both so): what follows up to the next KEY=
LIST_KEYS = ("pipeline_layout=", "recompute_modules=")


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
    ``pipeline_layout``: Megatron-Core's ``--pipeline-model-parallel-layout``
    string (``Et|(tt|)*30mL``; :mod:`opsched.cost.pipeline_split`), which
    sets vpp to its chunks / pp; ``first_layers`` / ``last_layers``: the
    layers of the first / last pipeline rank (``--decoder-first-pipeline-num-layers``,
    ``--decoder-last-pipeline-num-layers``; 0: as the others). Megatron
    takes at most one of the three ways of an uneven split, and neither
    with ``ends_as_layers``.
    The expert grid ``ep x etp`` is carved out of the ``tp x cp x dp``
    devices of a pipeline rank, which it must divide (Megatron-Core's
    parallel folding: TP2 with EP32 and ETP1 on 32 ranks per stage is a
    layout); opsched's expert-parallel mode spreads the experts over the
    whole group, ``etp = 1`` and ``ep = tp x dp``. ``max_nodes``: each
    token's experts on at most that many nodes (DeepSeek-V3's node-limited
    routing; Megatron-Core's ``--moe-router-group-topk`` with one group per
    node), which the expert all-to-all's cost reads; 0, no limit.

    >>> ParallelLayout(tp=2, ep=4, etp=1).resolved(4).dp
    2
    >>> ParallelLayout(tp=2, pp=1, ep=32, etp=1).resolved(32).dp
    16
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
    pipeline_layout: str = ""
    first_layers: int = 0
    last_layers: int = 0
    max_nodes: int = 0
    recompute_modules: str = ""
    encoders_first: bool = False

    @classmethod
    def parse(cls, text: str) -> "ParallelLayout":
        """Read ``"tp=1,pp=4,vpp=8,ep=8,zero=1,recompute=selective,sp=1"`` (any order, each key once).

        A ``pipeline_layout`` value may hold Megatron's cosmetic commas: what follows it up to the next
        ``KEY=`` belongs to it.

        >>> lay = ParallelLayout.parse("pp=16,pipeline_layout=Et|(tt|)*30,m,L,ep=8")
        >>> lay.vpp, lay.ep, lay.pipeline_layout
        (2, 8, 'Et|(tt|)*30mL')
        """
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, object] = {}
        items: list[str] = []
        for part in filter(None, (part.strip() for part in text.split(","))):
            if "=" not in part and items and items[-1].startswith(LIST_KEYS):
                items[-1] += ("+" if items[-1].startswith("recompute_modules=") else "") + part  # a list's comma
            else:
                items.append(part)
        for item in items:
            key, sep, value = item.partition("=")
            key = key.strip()
            if key == "recompute_modules" and sep:
                if key in values:
                    raise OpschedError("layout sets recompute_modules twice")
                values[key] = cls._recompute_modules(value)
                continue
            if key == "pipeline_layout" and sep:
                if key in values:
                    raise OpschedError("layout sets pipeline_layout twice")
                values[key] = value.strip()
                expand_pipeline_layout(value)  # a malformed string is refused here, in its own words
                continue
            if not sep or key not in known:
                raise OpschedError(f"layout item {item!r} is not KEY=VALUE with KEY one of {', '.join(sorted(known))}")
            if key in values:
                raise OpschedError(f"layout sets {key} twice")
            choices = {"recompute": RECOMPUTE_MODES, "attention": ATTENTION_MODES}.get(key)
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
                if number not in ZERO_LEVELS:
                    raise OpschedError(f"layout zero={value}: one of {', '.join(map(str, ZERO_LEVELS))}")
                values[key] = number
            else:
                least = 0 if key in ("dp", "etp", "max_nodes") else 1  # 0: derived (dp), tp (etp), no limit
                if number < least:
                    raise OpschedError(f"layout {key}={value}: must be at least {least}")
                values[key] = number
        if values.get("pipeline_layout"):
            values.update(vpp=cls._vpp_of_layout_string(values))
        return cls(**values)  # type: ignore[arg-type]

    @staticmethod
    def _recompute_modules(text: str) -> str:
        """Megatron's recompute modules, ``+`` or ``,`` between them, checked: the value kept ``+``-joined."""
        names = [m.strip() for m in text.replace(",", "+").split("+") if m.strip()]
        unknown = [m for m in names if m not in RECOMPUTE_MODULES]
        if not names or unknown:
            raise OpschedError(f"layout recompute_modules={text!r}: name Megatron's modules, from "
                               f"{', '.join(RECOMPUTE_MODULES)}")
        return "+".join(dict.fromkeys(names))

    @property
    def recomputed_modules(self) -> tuple[str, ...]:
        """``recompute_modules`` as a tuple of Megatron's names."""
        return tuple(self.recompute_modules.split("+")) if self.recompute_modules else ()

    @staticmethod
    def _vpp_of_layout_string(values: dict[str, object]) -> int:
        """vpp as a layout string sets it (its chunks / pp), refusing what Megatron refuses beside one."""
        text = str(values["pipeline_layout"])
        clash = [k for k in ("first_layers", "last_layers", "ends_as_layers") if values.get(k)]
        if clash:
            raise OpschedError(f"pipeline_layout cannot go with {', '.join(clash)} (Megatron takes one way of "
                               "splitting the layers); drop one")
        chunks = len(expand_pipeline_layout(text))
        pp = int(values.get("pp", 1))  # type: ignore[call-overload]
        if chunks % pp:
            raise OpschedError(f"pipeline_layout={text} has {chunks} chunks, no multiple of pp={pp}; "
                               f"set pp to a divisor of {chunks} or write {pp} x vpp chunks")
        if "vpp" in values and values["vpp"] != chunks // pp:
            raise OpschedError(f"vpp={values['vpp']} but pipeline_layout={text} has {chunks} chunks = pp {pp} x "
                               f"vpp {chunks // pp}; leave vpp out (the layout sets it)")
        return chunks // pp

    def resolved(self, devices: int) -> "ParallelLayout":
        """The layout with ``dp`` derived (``devices / (tp·pp·cp)``) and the degrees checked against the devices.

        Needs no model, so the command checks it before the import; :meth:`check_model` does the rest.
        """
        per_replica = self.tp * self.pp * self.cp
        dp = self.dp or devices // per_replica
        if per_replica * dp != devices:
            raise OpschedError(f"tp x pp x cp x dp = {self.tp} x {self.pp} x {self.cp} x {dp} = {per_replica * dp}, "
                               f"not the {devices} devices; change a degree or --devices")
        if self.vpp > 1 and self.pp < 2:
            raise OpschedError("vpp > 1 needs pp >= 2")
        if self.recompute_modules and self.recompute != "none":
            raise OpschedError(f"recompute_modules with recompute={self.recompute}: Megatron's modules are its "
                               "selective recomputation already; leave recompute out (none)")
        if (self.first_layers or self.last_layers) and self.ends_as_layers:
            raise OpschedError("first_layers / last_layers cannot go with ends_as_layers=1 (Megatron refuses "
                               "both); drop one")
        if self.tp_overlap and not (self.tp > 1 and self.sp):
            raise OpschedError("tp_overlap=1 needs tp > 1 and sp=1 (Megatron's --tp-comm-overlap runs with sequence "
                               "parallelism only)")
        etp = self.etp or self.tp
        per_rank = self.tp * self.cp * dp
        if per_rank % (self.ep * etp):
            raise OpschedError(f"ep x etp = {self.ep} x {etp} must divide tp x cp x dp = {self.tp} x {self.cp} x {dp}"
                               f" = {per_rank}: the expert layers are laid over a pipeline rank's devices "
                               "(Megatron-Core's parallel folding); change ep, etp or dp")
        if (self.tp * self.cp) % etp:
            raise OpschedError(f"etp={etp} must divide tp x cp = {self.tp * self.cp}: opsched costs an expert's "
                               "tensor-parallel ranks within the ranks that split one sequence")
        return dataclasses.replace(self, dp=dp)

    @property
    def devices(self) -> int:
        """Devices the (resolved) layout runs on: tp x pp x cp x dp."""
        return self.tp * self.pp * self.cp * self.dp

    def chunk_units(self, layers: int, mtp_layers: int = 0) -> tuple[str, ...]:
        """The chunks' units (:func:`opsched.cost.pipeline_split.chunk_units`) for a model of ``layers`` decoder
        layers and ``mtp_layers`` MTP layers, or :class:`OpschedError` naming the fixes."""
        return chunk_units(layers=layers, mtp_layers=mtp_layers, pp=self.pp, vpp=self.vpp,
                           ends_as_layers=self.ends_as_layers, first_layers=self.first_layers,
                           last_layers=self.last_layers, pipeline_layout=self.pipeline_layout)

    def check_model(self, layers: int, experts: int, mtp_layers: int = 0, heads: int = 0) -> None:
        """Refuse a layout the model cannot take: tp that does not divide its attention ``heads`` (the greatest
        common divisor of every attention's query and key-value heads: Megatron-Core splits both over the
        tensor-parallel ranks; 0: not known), ep that does not divide its experts, chunks of partial layers."""
        if heads and heads % self.tp:
            fits = [t for t in range(1, heads + 1) if heads % t == 0]
            raise OpschedError(f"tp={self.tp} does not divide the attention heads (their query and key-value heads "
                               f"share {heads} as greatest common divisor): use tp={', '.join(map(str, fits))}")
        expert_keys = [f"{k}={v}" for k, v in (("etp", self.etp), ("max_nodes", self.max_nodes)) if v]
        if expert_keys and experts == 0:  # they shape the expert layers alone: refused like ep, not ignored
            raise OpschedError(f"{', '.join(expert_keys)} but the model has no experts; leave "
                               f"{' and '.join(k.split('=')[0] for k in expert_keys)} out")
        if self.ep > 1:
            if experts == 0:
                raise OpschedError(f"ep={self.ep} but the model has no experts; use ep=1")
            if experts % self.ep:
                raise OpschedError(f"ep={self.ep} does not divide the {experts} experts of an MoE layer")
        self.chunk_units(layers, mtp_layers)

    def __str__(self) -> str:
        text = f"tp{self.tp} pp{self.pp}" + (f" vpp{self.vpp}" if self.vpp > 1 else "") + \
            (f" cp{self.cp}" if self.cp > 1 else "") + \
            (f" ep{self.ep}" if self.ep > 1 else "") + (f" etp{self.etp}" if self.etp else "") + f" dp{self.dp}"
        return text + (" sp" if self.sp else "") + (f" zero{self.zero}" if self.zero else "") + \
            (f" recompute={self.recompute}" if self.recompute != "none" else "") + \
            (" ends-as-layers" if self.ends_as_layers else "") + (" tp-overlap" if self.tp_overlap else "") + \
            (f" attention={self.attention}" if self.attention != "fused" else "") + \
            (f" pipeline_layout={compact_pipeline_layout(expand_pipeline_layout(self.pipeline_layout))}"
             if self.pipeline_layout else "") + \
            (f" first_layers={self.first_layers}" if self.first_layers else "") + \
            (f" last_layers={self.last_layers}" if self.last_layers else "") + \
            (f" max_nodes={self.max_nodes}" if self.max_nodes else "") + \
            (f" recompute_modules={self.recompute_modules}" if self.recompute_modules else "") + \
            (" encoders-first" if self.encoders_first else "")
