"""The machine and the training settings a plan is made for.

A :class:`Cluster` describes identical devices packed ``devices_per_node`` to a
node: peak FLOP/s per dtype with an achievable-efficiency factor, memory
capacity and bandwidth, and the bandwidth and latency of the links inside a
node and between nodes. :class:`Training` holds what the step looks like:
microbatch count and size, the compute dtype and the bytes each parameter
costs in memory (weights + gradients + optimizer state).

Clusters come from a named preset (:data:`PRESETS`) or a JSON / TOML file
(:func:`load_cluster`); :func:`resolve_cluster` implements the CLI rule
"``--devices N`` alone picks the default preset". Every field is checked:
a missing or negative one is an :class:`OpschedError` naming it.

>>> c = preset("h100-sxm", devices=16)
>>> c.nodes, c.flops_per_second("bf16") == 989e12 * 0.5
(2, True)
>>> parse_bytes("80GiB") == 80 * 2**30
True
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from opsched.errors import OpschedError
from opsched.model.recompute_modules import RECOMPUTE_MODULES
from opsched.units import plain

#: preset used when only ``--devices N`` is given
DEFAULT_PRESET = "h100-sxm"

#: Adam's state per parameter by the precision it is kept in (``--optimizer-state``, docs/cost-model.md,
#: "Training settings"). "fp32": an FP32 master weight and FP32 first and second moments, 4 + 4 + 4 = 12.
#: "bf16": BF16 moments (2 + 2) and the FP32 master weight kept as the 16 bits it has beyond the BF16 weight
#: (2): Megatron-Core's precision-aware optimizer with ``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``, whose
#: Transformer Engine FusedAdam stores those remainders (``store_param_remainders``, its default from TE 2.1).
OPTIMIZER_STATE_BYTES = {"fp32": 12.0, "bf16": 6.0}

#: Adam in mixed precision: bf16 weight (2) + bf16 gradient (2) + fp32 master
#: weight, first and second moment (4 + 4 + 4 = 12) = 16 bytes per parameter.
ADAM_MIXED_PRECISION_BYTES = {"param": 2.0, "grad": 2.0, "optimizer": OPTIMIZER_STATE_BYTES["fp32"]}

DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


def attention_dtype(dtype: str) -> str:
    """The precision attention runs in under a training ``dtype``: FP8 recipes keep it in BF16 (Transformer Engine's
    default, ``fp8_dpa=False``; torchtitan's Float8 converts only linear layers).

    >>> attention_dtype("fp8"), attention_dtype("fp16")
    ('bf16', 'fp16')
    """
    return "bf16" if dtype == "fp8" else dtype


@dataclass(frozen=True)
class Cluster:
    """Identical devices, ``devices_per_node`` to a node.

    Units: FLOP/s, bytes, bytes/s, seconds. ``efficiency`` scales peak FLOP/s
    to what dense training kernels achieve (model FLOPs utilisation).
    """

    name: str
    devices: int
    devices_per_node: int
    peak_flops: Mapping[str, float]  # dtype -> peak dense FLOP/s of one device
    efficiency: float
    memory_bytes: float  # capacity of one device
    memory_bandwidth: float  # bytes/s of one device's memory
    intra_node_bandwidth: float  # bytes/s, one direction, between two devices of a node
    intra_node_latency: float  # seconds per message
    inter_node_bandwidth: float  # bytes/s, one direction, per device across nodes
    inter_node_latency: float
    #: achievable fraction of peak for matrix multiplies, per dtype (missing dtype: ``efficiency``)
    matmul_efficiency: Mapping[str, float] = field(default_factory=dict)
    #: achievable fraction of the BF16 peak for fused attention (None: ``efficiency``)
    attention_efficiency: float | None = None
    #: achievable fraction of ``memory_bandwidth`` for memory-bound operators
    memory_efficiency: float = 1.0

    @property
    def nodes(self) -> int:
        """Number of nodes (the last one may be partly used)."""
        return math.ceil(self.devices / self.devices_per_node)

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def flops_per_second(self, dtype: str) -> float:
        """Achievable FLOP/s of one device in ``dtype`` (peak × efficiency)."""
        if dtype not in self.peak_flops:
            known = ", ".join(sorted(self.peak_flops))
            raise OpschedError(f"cluster {self.name!r} has no peak FLOP/s for dtype {dtype!r}; known: {known}")
        return float(self.peak_flops[dtype]) * self.efficiency

    @property
    def costs_by_kind(self) -> bool:
        """Whether the cluster sets an efficiency by kind of operator (else one roofline at ``efficiency``)."""
        return bool(self.matmul_efficiency) or self.attention_efficiency is not None or self.memory_efficiency != 1.0

    def matmul_flops_per_second(self, dtype: str) -> float:
        """Achievable FLOP/s of one device's matrix multiplies in ``dtype``."""
        return self.flops_per_second(dtype) / self.efficiency * self.matmul_efficiency.get(dtype, self.efficiency)

    def attention_flops_per_second(self, dtype: str) -> float:
        """Achievable FLOP/s of fused attention, in :func:`attention_dtype` where the device has its peak."""
        compute = self.attention_compute_dtype(dtype)
        fraction = self.efficiency if self.attention_efficiency is None else self.attention_efficiency
        return self.flops_per_second(compute) / self.efficiency * fraction

    def attention_compute_dtype(self, dtype: str) -> str:
        """The dtype whose peak attention runs at: :func:`attention_dtype`, or ``dtype`` on a device without it."""
        return attention_dtype(dtype) if attention_dtype(dtype) in self.peak_flops else dtype

    def link(self, devices_a: tuple[int, ...], devices_b: tuple[int, ...]) -> tuple[float, float]:
        """(bandwidth, latency) of the slowest link between two device sets.

        Intra-node when every device of both sets sits on one node, else inter-node.
        """
        # one node iff the lowest and the highest device share it (nodes hold consecutive devices): O(n) in C, where
        # a set of nodes per call took half the layout search's costing at 3,072 devices
        ends = [end(group) for group in (devices_a, devices_b) if group for end in (min, max)]
        if not ends or self.node_of(min(ends)) == self.node_of(max(ends)):
            return self.intra_node_bandwidth, self.intra_node_latency
        return self.inter_node_bandwidth, self.inter_node_latency


#: activation recomputation settings (docs/cost-model.md, "Recomputation"), cheapest first: the one list of them
#: (``--recompute``'s choices, ``Training``'s check, layouts' ``recompute=``); the layout search tries them in this
#: order and a layout keeps the first that fits (selective runs the attention core's forward again, full the whole
#: forward)
RECOMPUTE_MODES = ("none", "selective", "full")

#: how attention runs (docs/cost-model.md, "Unfused attention"): "fused", one kernel whose scores never leave the
#: chip (FlashAttention, cuDNN, torch's SDPA); "unfused", Megatron-LM's attention before FlashAttention
ATTENTION_MODES = ("fused", "unfused")


#: ZeRO levels over data-parallel replicas, what each shards (``cost.blocks.held_param_bytes`` costs them): the
#: one list ``--zero``'s choices and help, the layout key ``zero=`` and :class:`Training` read
ZERO_LEVELS: dict[int, str] = {
    0: "every data-parallel replica holds the whole optimizer state",
    1: "the optimizer states are sharded over the data-parallel replicas (Megatron's distributed optimizer), "
       "for the same gradient traffic",
    2: "the optimizer states and the gradients are sharded",
    3: "the optimizer states, gradients and weights are sharded, the weights gathered before each forward and "
       "backward (FSDP's full shard)",
}


@dataclass(frozen=True)
class Training:
    """What one training step looks like.

    ``microbatch_size`` is the number of samples in a microbatch; block costs
    come from the import dims, so it is used to report samples/s and to say
    which parallel modes split sequences (``cost.blocks.modes_for``).
    ``bytes_per_param`` is the memory each parameter costs on a device that
    holds it: weight + gradient + optimizer state (default: Adam in mixed
    precision, 2 + 2 + 12 = 16; ``optimizer_state="bf16"``: 2 + 2 + 6 = 10).
    ``grad_bytes`` is the size of one gradient element on the wire (the
    data-parallel all-reduce).

    >>> Training().bytes_per_param, Training(optimizer_state="bf16").bytes_per_param
    (16.0, 10.0)
    """

    microbatches: int = 8
    microbatch_size: int = 1
    dtype: str = "bf16"
    param_bytes: float = ADAM_MIXED_PRECISION_BYTES["param"]
    grad_bytes: float = ADAM_MIXED_PRECISION_BYTES["grad"]
    #: the precision Adam's state is kept in, a key of :data:`OPTIMIZER_STATE_BYTES` (its bytes: ``optimizer_bytes``)
    optimizer_state: str = "fp32"
    #: ZeRO level over data-parallel replicas (0: none; 1: optimizer states sharded, Megatron's
    #: distributed optimizer; 2: gradients too; 3: weights too), see ``cost.held_param_bytes``
    zero: int = 0
    #: activation recomputation: "none"; "selective" (the attention core's forward runs again in the backward,
    #: its intermediates are not stored); "full" (each block keeps its input and runs its forward again)
    recompute: str = "none"
    #: Megatron's sequence parallelism with tensor parallelism: what each tensor-parallel rank would hold whole
    #: (norms, residual adds, row-parallel outputs) is split along the sequence (False: held whole on every rank)
    sequence_parallel: bool = True
    #: data-parallel replicas take whole sequences: a block's dp degree divides ``microbatch_size`` (False: a
    #: split whose replicas would not is planned as context parallelism, its K/V ring costed: cost.blocks.modes_for)
    whole_sequences: bool = False
    #: an overlapped F&B pair runs one pass's communication under the other's compute (a runtime that overlaps
    #: them, as DualPipe's does); False: a pair costs its two passes, as torch runs OVERLAP_F_B (F, then B)
    overlap_pairs: bool = True
    #: Megatron's ``--tp-comm-overlap`` (Transformer Engine's userbuffers, with sequence parallelism): a block's
    #: tensor-parallel collectives run under its GEMMs (``cost.tp_comm_overlapped``); False: they run exposed
    tp_comm_overlap: bool = False
    #: one of :data:`ATTENTION_MODES`: "unfused" runs Q·Kᵀ and scores·V as batched GEMMs with the scores in memory
    #: between them (scale-mask-softmax and dropout read and write them), ``cost.unfused_attention_time``
    attention: str = "fused"
    #: Megatron's recompute modules (:data:`opsched.model.recompute_modules.RECOMPUTE_MODULES`) whose forward runs
    #: again in the backward and saves nothing, beside ``recompute`` (which must then be "none")
    recompute_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if unknown:
            raise OpschedError(f"recompute module {unknown[0]!r} is not Megatron's; choose from "
                               f"{', '.join(RECOMPUTE_MODULES)}")
        if self.recompute not in RECOMPUTE_MODES:
            raise OpschedError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}")
        if self.attention not in ATTENTION_MODES:
            raise OpschedError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {self.attention!r}")
        if self.zero not in ZERO_LEVELS:
            raise OpschedError(f"ZeRO level must be one of {', '.join(map(str, ZERO_LEVELS))}, got {self.zero!r}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise OpschedError(f"microbatches must be a positive integer, got {self.microbatches!r}; pass --microbatches M with M >= 1")
        if not isinstance(self.microbatch_size, int) or self.microbatch_size < 1:
            raise OpschedError(f"microbatch size must be a positive integer, got {self.microbatch_size!r}")
        if self.dtype not in DTYPE_BYTES:
            raise OpschedError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
        if self.optimizer_state not in OPTIMIZER_STATE_BYTES:
            raise OpschedError(f"optimizer state must be one of {', '.join(OPTIMIZER_STATE_BYTES)}, "
                               f"got {self.optimizer_state!r}")
        for name in ("param_bytes", "grad_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise OpschedError(f"training setting {name} must be a number >= 0, got {value!r}")

    @property
    def optimizer_bytes(self) -> float:
        """Adam's state per parameter: master weight and two moments in ``optimizer_state``'s precision."""
        return OPTIMIZER_STATE_BYTES[self.optimizer_state]

    @property
    def bytes_per_param(self) -> float:
        """Memory per parameter held: weight + gradient + optimizer state."""
        return float(self.param_bytes + self.grad_bytes + self.optimizer_bytes)

    @property
    def optimizer_step_bytes(self) -> float:
        """Memory traffic of one Adam step per parameter it updates: the state read and written, the gradient read
        and the weight written; a master weight kept as remainders of the weight reads the weight too.

        >>> Training().optimizer_step_bytes, Training(optimizer_state="bf16").optimizer_step_bytes
        (28.0, 18.0)
        """
        remainders = self.param_bytes if self.optimizer_state == "bf16" else 0.0
        return float(2 * self.optimizer_bytes + self.grad_bytes + self.param_bytes + remainders)


# --------------------------------------------------------------------------- presets

# Figures are public datasheet values: dense (no sparsity) tensor-core FLOP/s,
# HBM capacity and bandwidth, NVLink bandwidth per direction (half the
# bidirectional figure), one 400 Gb/s (H100/H200) or 200 Gb/s (A100) NIC per GPU.
# Latencies are typical small-message figures. Efficiencies by kind of operator (docs/cost-model.md,
# "Efficiency by operator kind"): fitted to the published training runs of each GPU
# (benchmarks/bench_published.py: A100 rows for a100-80g, H100 rows for h100-sxm; h200 takes the H100's),
# on a grid (H100: matmul 0.55-0.75, attention 0.35-0.55, memory 0.5-0.9; A100, refitted once the SC'21 and
# BLOOM rows ran their attention unfused: matmul 0.65-0.75, attention 0.45-0.6, the FlashAttention-2
# ceiling being 0.63, memory 0.5-0.9), checked out of sample (fitted on half the rows, the other half within
# +-15 % as often as or more often than with one efficiency of 0.5 for everything); docs/BENCHMARKS.md,
# "Against published runs". FP8 matmuls: 0.6 of the FP8 peak, the
# kernel ceiling of benchmarks/clusters/ (1,170 of 1,979 TFLOP/s), which the H100 FP8 rows favour. They
# are training figures, below the kernels' own ceilings (benchmarks/clusters/, with their sources).
# ``efficiency`` (0.5) is left for FLOPs of no known kind.
#: the H100 SXM preset, which the presets of the same silicon (h200, h800) start from
_H100_SXM = Cluster(
    name="h100-sxm",
    devices=8,  # one node; preset(name, devices) sets the count
    devices_per_node=8,
    peak_flops={"fp8": 1979e12, "bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    efficiency=0.5,
    memory_bytes=80e9,
    memory_bandwidth=3.35e12,
    matmul_efficiency={"bf16": 0.65, "fp16": 0.65, "fp8": 0.6},
    attention_efficiency=0.35,
    memory_efficiency=0.9,
    intra_node_bandwidth=450e9,
    intra_node_latency=5e-6,
    inter_node_bandwidth=50e9,
    inter_node_latency=10e-6,
)

#: the cluster presets (``--preset``), one node each: the one map the CLI's help, cluster files' ``preset`` key
#: and :func:`preset` read
PRESETS: dict[str, Cluster] = {c.name: c for c in (
    _H100_SXM,
    Cluster(
        name="a100-80g",
        devices=8,  # one node; preset(name, devices) sets the count
        devices_per_node=8,
        peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
        efficiency=0.5,
        memory_bytes=80e9,
        memory_bandwidth=2.039e12,
        matmul_efficiency={"bf16": 0.7, "fp16": 0.7},
        attention_efficiency=0.6,
        memory_efficiency=0.8,
        intra_node_bandwidth=300e9,
        intra_node_latency=5e-6,
        inter_node_bandwidth=25e9,
        inter_node_latency=10e-6,
    ),
    # the H100 SXM with 141 GB of HBM3e at 4.8 TB/s (NVIDIA H200 datasheet)
    replace(_H100_SXM, name="h200", memory_bytes=141e9, memory_bandwidth=4.8e12),
    # H800 SXM: the H100 SXM's compute and memory with NVLink cut to 400 GB/s bidirectional (200 per direction;
    # DeepSeek-V3 measures about 160 GB/s achieved, arXiv 2412.19437 §3.2.2) and one 400 Gb/s InfiniBand NIC
    # per GPU, 50 GB/s (ISCA'25 "Insights into DeepSeek-V3", arXiv 2505.09343 §2.2, Table 1: the same SXM5
    # part as the H100 with reduced NVLink). Efficiencies are the H100's: the same silicon.
    replace(_H100_SXM, name="h800", intra_node_bandwidth=200e9),
    # GB200 NVL72: 72 Blackwell GPUs in one NVLink domain (the "node"), the rack datasheet's dense figures per
    # GPU (NVIDIA GB200 NVL72 datasheet: FP8 720 PFLOPS and FP16/BF16 360 PFLOPS with sparsity, halved for
    # dense and divided by 72 GPUs: 5.0 and 2.5 PFLOPS; FP32 5,760 TFLOPS / 72 = 80; HBM3e 13.4 TB and
    # 576 TB/s / 72 = 186 GB and 8 TB/s; NVLink 130 TB/s / 72 = 1.8 TB/s bidirectional, 900 GB/s a direction),
    # one 400 Gb/s ConnectX-7 NIC per GPU between racks. Efficiencies are the H100's until a published
    # GB200 training run is fitted (none is in benchmarks/bench_published.py yet).
    Cluster(
        name="gb200",
        devices=72,  # one node; preset(name, devices) sets the count
        devices_per_node=72,
        peak_flops={"fp8": 5000e12, "bf16": 2500e12, "fp16": 2500e12, "fp32": 80e12},
        efficiency=0.5,
        memory_bytes=186e9,
        memory_bandwidth=8e12,
        matmul_efficiency={"bf16": 0.65, "fp16": 0.65, "fp8": 0.6},
        attention_efficiency=0.35,
        memory_efficiency=0.9,
        intra_node_bandwidth=900e9,
        intra_node_latency=5e-6,
        inter_node_bandwidth=50e9,
        inter_node_latency=10e-6,
    ),
    # GraphPipe's testbed (ASPLOS'25, section 6: Summit, V100-SXM2-16GB, 4 GPUs used a node, NVLink, 100 Gb/s
    # InfiniBand). NVIDIA V100 datasheet (SXM2): 125 TFLOP/s fp16 tensor cores, 15.7 TFLOP/s fp32, 16 GB HBM2
    # at 900 GB/s, NVLink 300 GB/s bidirectional over 6 links. V100s have no bfloat16: a V100 trains in fp16
    # mixed precision, so "bf16" (the planner's default compute precision, Training.dtype) is the fp16 tensor-core
    # peak, with the same 2 bytes a value. Intra-node: Summit links two GPUs of a socket by 2 NVLink-2 links, 50 GB/s each way. Inter-node:
    # 100 Gb/s (12.5 GB/s) shared by the node's 4 GPUs, 3.125 GB/s each when all of them send at once (as a
    # pipeline's group does). No published V100 row was fitted: one efficiency (0.5) for every kind.
    Cluster(
        name="v100-16g",
        devices=4,  # one node; preset(name, devices) sets the count
        devices_per_node=4,
        peak_flops={"bf16": 125e12, "fp16": 125e12, "fp32": 15.7e12},
        efficiency=0.5,
        memory_bytes=16e9,
        memory_bandwidth=900e9,
        intra_node_bandwidth=50e9,
        intra_node_latency=5e-6,
        inter_node_bandwidth=12.5e9 / 4,
        inter_node_latency=10e-6,
    ),
)}

_NUMBER_FIELDS = (
    "devices_per_node",
    "efficiency",
    "memory_bytes",
    "memory_bandwidth",
    "intra_node_bandwidth",
    "intra_node_latency",
    "inter_node_bandwidth",
    "inter_node_latency",
)


def preset(name: str, devices: int | None = None) -> Cluster:
    """The named preset cluster with ``devices`` devices (default: one node).

    >>> preset("a100-80g").devices
    8
    """
    if name not in PRESETS:
        raise OpschedError(f"unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    spec = preset_fields(name)
    spec["devices"] = spec["devices_per_node"] if devices is None else devices
    return cluster_from_dict(spec, source=f"preset {name}", name=name)


def preset_fields(name: str) -> dict[str, Any]:
    """The named preset's fields but its name, as a cluster file writes them (a file's ``preset`` key starts from
    these).

    >>> preset_fields("h200")["memory_bytes"]
    141000000000.0
    """
    return {f.name: getattr(PRESETS[name], f.name) for f in fields(Cluster) if f.name != "name"}


def cluster_from_dict(spec: Mapping[str, Any], source: str = "cluster", name: str | None = None) -> Cluster:
    """Build and check a :class:`Cluster` from a mapping.

    A ``"preset"`` key names a preset whose fields fill in what ``spec`` leaves
    out. Every field must be present and every number positive (latencies
    may be 0; efficiency must lie in (0, 1]).
    """
    spec = dict(spec)
    base = spec.pop("preset", None)
    if base is not None:
        if base not in PRESETS:
            raise OpschedError(f"{source}: unknown preset {base!r}; choose one of {', '.join(sorted(PRESETS))}")
        merged = preset_fields(base)
        merged.update(spec)
        spec = merged
    known = {f.name for f in fields(Cluster)}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise OpschedError(f"{source}: unknown field {unknown[0]!r}; fields are {', '.join(sorted(known - {'name'}))}")
    for key in ("devices",) + _NUMBER_FIELDS + ("peak_flops",):
        if key not in spec:
            raise OpschedError(f"{source}: missing field {key!r}; add it (see docs/cost-model.md) or start from a preset")
    for key in ("devices", "devices_per_node"):
        if not isinstance(spec[key], int) or isinstance(spec[key], bool) or spec[key] < 1:
            raise OpschedError(f"{source}: field {key!r} must be a positive integer, got {spec[key]!r}")
    for key in _NUMBER_FIELDS[1:]:
        value = spec[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise OpschedError(f"{source}: field {key!r} must be a number, got {value!r}")
        if value < 0 or (value == 0 and not key.endswith("latency")):
            raise OpschedError(f"{source}: field {key!r} must be positive, got {value!r}")
    if spec["efficiency"] > 1:
        raise OpschedError(f"{source}: field 'efficiency' is a fraction of peak in (0, 1], got {spec['efficiency']!r}")
    peaks = spec["peak_flops"]
    if not isinstance(peaks, Mapping) or not peaks:
        raise OpschedError(f"{source}: field 'peak_flops' must map dtypes to FLOP/s, e.g. {{\"bf16\": 989e12}}")
    for dtype, value in peaks.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise OpschedError(f"{source}: peak_flops[{dtype!r}] must be a positive number, got {value!r}")
    _check_kind_efficiencies(spec, source)
    values = {k: spec[k] for k in spec if k != "name"}
    values["matmul_efficiency"] = {str(k): float(v) for k, v in spec.get("matmul_efficiency", {}).items()}
    values["peak_flops"] = {str(k): float(v) for k, v in peaks.items()}
    return Cluster(name=str(name or spec.get("name") or base or "custom"), **values)


def _check_kind_efficiencies(spec: Mapping[str, Any], source: str) -> None:
    """The optional efficiencies by operator kind: fractions in (0, 1]."""
    def fraction(name: str, value: Any) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
            raise OpschedError(f"{source}: {name} is a fraction in (0, 1], got {value!r}")

    matmul = spec.get("matmul_efficiency", {})
    if not isinstance(matmul, Mapping):
        raise OpschedError(f"{source}: field 'matmul_efficiency' must map dtypes to fractions, e.g. {{\"bf16\": 0.8}}")
    for dtype, value in matmul.items():
        fraction(f"matmul_efficiency[{dtype!r}]", value)
    if spec.get("attention_efficiency") is not None:
        fraction("field 'attention_efficiency'", spec["attention_efficiency"])
    if "memory_efficiency" in spec:
        fraction("field 'memory_efficiency'", spec["memory_efficiency"])


def load_cluster(path: str | Path, devices: int | None = None) -> Cluster:
    """Read a cluster from a ``.json`` or ``.toml`` file; ``devices`` overrides the file's count.

    TOML needs Python 3.11 (tomllib); on 3.10 use JSON.
    """
    p = Path(path)
    if not p.is_file():
        raise OpschedError(f"cluster file {str(p)!r} does not exist; pass --cluster PATH to a .json or .toml file")
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            raise OpschedError(f"reading {p} needs Python >= 3.11 (tomllib); write the cluster as JSON instead") from None
        try:
            spec = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise OpschedError(f"cluster file {p} is not valid TOML: {exc}") from None
    else:
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise OpschedError(f"cluster file {p} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(spec, dict):
        raise OpschedError(f"cluster file {p} must hold one object of fields")
    if devices is not None:
        spec["devices"] = devices
    return cluster_from_dict(spec, source=f"cluster file {p}")


def resolve_cluster(devices: int | None = None, cluster_file: str | None = None, preset_name: str | None = None) -> Cluster:
    """The CLI rule: a file, else a preset, else the default preset; ``devices`` overrides.

    >>> resolve_cluster(devices=16).name
    'h100-sxm'
    """
    if devices is not None and (not isinstance(devices, int) or devices < 1):
        raise OpschedError(f"--devices must be a positive integer, got {devices!r}")
    if cluster_file and preset_name:
        raise OpschedError("give either --cluster FILE or --preset NAME, not both")
    if cluster_file:
        return load_cluster(cluster_file, devices)
    if devices is None and preset_name is None:
        raise OpschedError("say how many devices to plan for: --devices N (or a --cluster file that sets devices)")
    return preset(preset_name or DEFAULT_PRESET, devices)


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | float | int) -> float:
    """Parse a memory size: ``80GiB``, ``80GB``, ``8e10``, ``512MiB``.

    >>> parse_bytes("1.5 GB")
    1500000000.0
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise OpschedError(f"cannot read memory size {text!r}; write e.g. 80GiB, 80GB or 8e10")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise OpschedError(f"memory size must be positive, got {text!r}")
    return value


def with_devices(cluster: Cluster, devices: int) -> Cluster:
    """The same cluster with a different device count."""
    if devices < 1:
        raise OpschedError(f"devices must be at least 1, got {devices}")
    return replace(cluster, devices=devices)


def memory_hint(smallest: float, cluster: Cluster) -> str:
    """What to change when a plan needs ``smallest`` bytes per device: a memory limit the device has, else more devices or a larger preset.

    A suggested ``--memory-limit`` is never above the device's own memory.

    >>> memory_hint(60 * 2**30, preset("h100-sxm", 8))
    'pass --memory-limit 60GiB'
    >>> memory_hint(1.75 * 2**20, preset("h100-sxm", 8))
    'pass --memory-limit 2MiB'
    >>> memory_hint(74.3 * 2**30, preset("h100-sxm", 8))
    'leave out --memory-limit: the 80 GB of one h100-sxm device is enough'
    >>> memory_hint(94 * 2**30, preset("h100-sxm", 8))
    'more than the 80 GB of one h100-sxm device: use more devices (e.g. --devices 16) or --preset h200 (141 GB per device)'
    >>> memory_hint(760 * 2**30, preset("h100-sxm", 8))   # about ten devices' memory: 16 times as many devices
    'more than the 80 GB of one h100-sxm device: use more devices (e.g. --devices 128)'
    """
    own = cluster.memory_bytes
    # a device's own memory in decimal GB, as its vendor names it (an H100 is "80 GB"); never in exponent notation
    gb = lambda x: plain(x / 1e9, 3)  # noqa: E731
    if smallest <= own:
        unit, size = ("GiB", 2**30) if smallest >= 2**30 else ("MiB", 2**20)
        rounded = math.ceil(smallest / size)
        if rounded * size <= own:
            return f"pass --memory-limit {rounded}{unit}"
        return f"leave out --memory-limit: the {gb(own)} GB of one {cluster.name} device is enough"
    larger = sorted((spec.memory_bytes, name) for name, spec in PRESETS.items() if spec.memory_bytes >= smallest)
    preset_text = f" or --preset {larger[0][1]} ({gb(larger[0][0])} GB per device)" if larger else ""
    # the parameters' state, most of such a need, spreads over the devices: at least the need's multiple of the device
    # memory, rounded up to a power of two times today's count (the layouts' degrees divide powers of two best)
    more = cluster.devices * 2 ** max(1, math.ceil(math.log2(smallest / own)))
    return (f"more than the {gb(own)} GB of one {cluster.name} device: use more devices "
            f"(e.g. --devices {more}){preset_text}")
