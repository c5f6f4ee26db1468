"""Time and memory of a block under a parallel mode, and of a transfer between groups.

One module, one set of formulas (written out in ``docs/cost-model.md``):

* **compute** (roofline): ``max(flops / (peak × eff), io_bytes / mem_bw)``;
* **backward**: I (input gradient) costs the forward again; W (weight
  gradient) costs the forward again only for blocks with parameters
  (a weight matmul ``Y = X·A`` has backward ``dX = dY·Aᵀ`` (I) and
  ``dA = Xᵀ·dY`` (W), each as many FLOPs as the forward);
* **tensor-parallel collectives** (Megatron): an all-reduce of each
  row-parallel layer's output in F and in I (:func:`tensor_parallel_bytes`);
* **recomputation** (``Training.recompute``): ``full``, the block keeps only
  its input per microbatch and runs its forward again before I;
  ``selective``, its attention core's forward runs again before I;
* **activations** stored: what the block's operators keep for the backward
  (:mod:`opsched.model.saved`), split over the mode's devices; without sequence
  parallelism the norms' inputs and outputs are held whole by every
  tensor-parallel rank (:func:`stored_activation_bytes`);
* **context parallelism**: ring attention's K/V exchange, overlapped with the
  attention (:func:`context_ring_time`);
* **parallel modes** on a group of ``k`` devices: tensor parallel degree
  ``tp``, data-parallel replicas ``dp`` (``tp × dp = k``), or expert parallel
  ``ep = k`` for blocks holding several experts;
* **collectives** by the alpha-beta model on the slowest link of the ranks
  involved: ring all-reduce ``2(k-1)α + 2(k-1)/k · n/β``, all-to-all
  ``(k-1)α + (k-1)/k · n/β``;
* **transfer** of ``n`` bytes between groups: ``α + n/β`` (0 on the same group).

>>> from opsched.cost.cluster import preset
>>> c = preset("h100-sxm")
>>> roofline_time(989e12 * 0.5, 0.0, c, "bf16")
1.0
>>> from opsched.cost.collectives import transfer_time
>>> transfer_time(50e9, preset("h100-sxm", 16), (0,), (8,))   # across nodes: 10 us + 50 GB / 50 GB/s
1.00001
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Sequence

from opsched.cost.cluster import DTYPE_BYTES, ZERO_LEVELS, Cluster, Training, attention_dtype
from opsched.cost.collectives import RingExchange, allreduce_time, context_ring_time, spread_alltoall_time
from opsched.errors import OpschedError
from opsched.model.graph import Block
from opsched.model.recompute_modules import kept_for_recompute, parts_of
from opsched.cost.overlap import COMM, COMPUTE, PassStreams, StreamOp, compact


#: a mode's degrees, in the order its name writes them (Megatron's rank order: tp innermost, then cp, then dp; ep
#: last): the one list :meth:`Mode.parse`, :meth:`Mode.__str__` and the layout notation's words
#: (:func:`opsched.upper.layouts.mode_words`) read
DEGREES = ("tp", "cp", "dp", "ep")


@dataclass(frozen=True, order=True)
class Mode:
    """How a block uses the ``tp × cp × dp × ep`` devices of its group.

    ``tp``: tensor-parallel degree (weights and compute split, activations
    all-reduced); ``dp``: data-parallel replicas (each takes 1/dp of the
    microbatch, gradients all-reduced once per step); ``ep``: expert-parallel
    degree (the block's experts spread over the devices, tokens exchanged by
    all-to-all); ``cp``: context-parallel degree (each sequence split over cp
    ranks that pass keys and values round a ring). The planner's own modes
    have ``cp = 1``; a Megatron-style layout with context parallelism
    (:mod:`opsched.plan.layouts`, which costs it) names its blocks' mode with
    ``cp`` so that plan.json carries it (``tp2.cp2.dp2``: Megatron's rank
    order, tp innermost, then cp, then dp).

    >>> str(Mode(tp=2, dp=4)), str(Mode()), Mode(ep=4).size, str(Mode(dp=4, cp=2))
    ('tp2.dp4', 'single', 4, 'cp2.dp4')
    """

    tp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.dp * self.ep

    def degrees(self) -> tuple[tuple[str, int], ...]:
        """(kind, degree) of each degree above 1, in :data:`DEGREES` order.

        >>> Mode(dp=4, tp=2).degrees(), Mode().degrees()
        ((('tp', 2), ('dp', 4)), ())
        """
        return tuple((kind, getattr(self, kind)) for kind in DEGREES if getattr(self, kind) > 1)

    def __str__(self) -> str:
        return ".".join(f"{k}{v}" for k, v in self.degrees()) or "single"

    @classmethod
    def parse(cls, text: str) -> "Mode":
        """The mode a name written by :meth:`__str__` stands for (plan.json keeps modes as names).

        >>> Mode.parse("tp2.dp4"), Mode.parse("single"), Mode.parse("ep8").size, Mode.parse("tp2.cp2.dp2").cp
        (Mode(tp=2, dp=4, ep=1, cp=1), Mode(tp=1, dp=1, ep=1, cp=1), 8, 2)
        >>> Mode.parse("tp2+ep")
        Traceback (most recent call last):
        ...
        opsched.errors.OpschedError: 'tp2+ep' is not a parallel mode (e.g. dp4, tp2.dp2, ep8, single)
        """
        if text == "single":
            return cls()
        degrees: dict[str, int] = {}
        for part in text.split("."):
            found = _MODE_PART.match(part)
            if not found or found.group(1) in degrees:
                raise OpschedError(f"{text!r} is not a parallel mode (e.g. dp4, tp2.dp2, ep8, single)")
            degrees[found.group(1)] = int(found.group(2))
        return cls(**degrees)


#: one degree of a mode's name: ``tp2``, ``cp2``, ``dp4``, ``ep8`` (a degree of 1 is left out of names)
_MODE_PART = re.compile(rf"^({'|'.join(DEGREES)})([2-9]|[1-9]\d+)$")


@dataclass(frozen=True)
class BlockCost:
    """Per-microbatch pass times (s) and per-device memory (bytes) of a block under a mode.

    ``grad_sync`` is the data-parallel gradient all-reduce, once per step (s).
    ``f_comm`` and ``i_comm`` are the communication inside F and I (the
    tensor-parallel all-reduces, the expert-parallel all-to-alls), and
    ``rerun_forward`` says I begins with the whole forward again (full
    recomputation, not counted in ``i_comm``): :meth:`streams` lays the
    passes out on the compute and communication streams from them.
    """

    F: float
    I: float  # noqa: E741 (the pass is called I)
    W: float
    param_bytes: float  # weights + gradients + optimizer state, per device
    act_bytes: float  # saved for backward per microbatch, per device, from F until I
    act_w_bytes: float  # of which kept until W
    grad_sync: float = 0.0
    f_comm: float = 0.0
    i_comm: float = 0.0
    rerun_forward: bool = False

    @property
    def work(self) -> float:
        """F + I + W: the device time one microbatch costs."""
        return self.F + self.I + self.W

    def streams(self) -> PassStreams:
        """The passes as chains of compute and communication operations (docs/cost-model.md, "Overlap").

        F and I alike: half the compute, half the communication, the other
        halves (Megatron's all-reduces after attention and after the MLP, and
        in I after each half's input gradient; an MoE layer's dispatch after
        attention and router, its combine after the experts); I after the
        whole F again under full recomputation. W: compute.

        >>> [(op.streams, op.seconds) for op in BlockCost(F=3, I=3, W=2, param_bytes=0, act_bytes=0,
        ...                                              act_w_bytes=0, f_comm=1, i_comm=1).streams().F]
        [(1, 1.0), (2, 0.5), (1, 1.0), (2, 0.5)]
        """
        forward = _halves(self.F - self.f_comm, self.f_comm)
        rerun = forward if self.rerun_forward else ()
        backward = _halves(self.I - self.i_comm - (self.F if self.rerun_forward else 0.0), self.i_comm)
        w = (StreamOp(COMPUTE, self.W),)
        return PassStreams(*(tuple(op for op in chain if op.seconds > 0) for chain in (forward, rerun + backward, w)))


def tp_comm_overlapped(cost: BlockCost, others: float = 0.0) -> BlockCost:
    """``cost`` with its tensor-parallel collectives run under its GEMMs: Megatron's ``--tp-comm-overlap``.

    Transformer Engine's userbuffer overlap splits each all-gather /
    reduce-scatter of a tensor-parallel layer into chunks that run while the
    GEMM beside it computes (Megatron-Core's ``tp_comm_overlap`` option), so
    a pass takes its compute, or its tensor-parallel communication when that
    is longer. ``others``: the part of ``f_comm`` and of ``i_comm`` that is
    not tensor-parallel (the expert all-to-alls), which stays exposed.
    :func:`block_cost` applies this when ``Training.tp_comm_overlap`` is set.

    >>> c = BlockCost(F=3.0, I=5.0, W=2.0, param_bytes=0, act_bytes=0, act_w_bytes=0, f_comm=1.0, i_comm=1.0)
    >>> o = tp_comm_overlapped(c)
    >>> o.F, o.I, o.f_comm, o.streams().total("F")
    (2.0, 4.0, 0.0, 2.0)
    >>> tp_comm_overlapped(c, others=0.5).F   # 2 of compute hide 0.5 of tp traffic; 0.5 of all-to-all stays
    2.5
    """
    f_compute = cost.F - cost.f_comm
    forward = max(f_compute, cost.f_comm - others) + others
    own_compute = cost.I - cost.i_comm - (cost.F if cost.rerun_forward else 0.0)
    own = max(own_compute, cost.i_comm - others) + others
    return dataclasses.replace(cost, F=forward, I=(forward if cost.rerun_forward else 0.0) + own,
                               f_comm=forward - f_compute, i_comm=own - own_compute)


def stage_streams(costs: Sequence[BlockCost], before: float = 0.0) -> PassStreams:
    """The stream operations of a stage running ``costs``' blocks in order (backwards in reverse).

    ``before``: communication ahead of F and of I (ZeRO-3's weight
    all-gather). Chains longer than :data:`opsched.cost.overlap.STORED_OPS`
    operations are compacted (:func:`opsched.cost.overlap.compact`).
    """
    return joined_streams([c.streams() for c in costs], before)


def joined_streams(chains: Sequence[PassStreams], before: float = 0.0) -> PassStreams:
    """:func:`stage_streams` from the blocks' own stream operations (:meth:`BlockCost.streams`), in block order."""
    gather = [StreamOp(COMM, before)] if before > 0 else []
    forward = gather + [op for c in chains for op in c.F]
    backward = gather + [op for c in reversed(chains) for op in c.I]
    weights = [op for c in reversed(chains) for op in c.W]
    return PassStreams(compact(forward), compact(backward), compact(weights))


def _halves(compute: float, comm: float) -> tuple[StreamOp, ...]:
    """Half the compute, half the communication, the other halves."""
    compute_half, comm_half = StreamOp(COMPUTE, max(0.0, compute) / 2), StreamOp(COMM, comm / 2)
    return (compute_half, comm_half, compute_half, comm_half)


_EXPERT_INDEX = re.compile(r"experts?[._/](\d+)", re.IGNORECASE)


def expert_count(block: Block) -> int:
    """Number of distinct experts whose operators the block holds (0 if none).

    Read from the module paths in operator names and the block scope
    (``.../experts.3/...``, ``expert_3``).

    >>> b = Block(0, "moe", ("layers.0", "mlp"), ops=("l0/experts.0/w1", "l0/experts.1/w1"))
    >>> expert_count(b)
    2
    """
    found = set()
    for text in (*block.ops, *block.scope, block.name):
        found.update(_EXPERT_INDEX.findall(text))
    return len(found)


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def modes_for(block: Block, group_size: int, samples: int | None = None, context: bool = False) -> list[Mode]:
    """The parallel modes a block may take on a group of ``group_size`` devices.

    Every split ``tp × dp = group_size`` whose data-parallel degree divides
    ``samples``, the sequences of a microbatch (``None``: any): replicas take
    whole sequences, never parts of one; with ``context``, a split whose
    replicas would not take whole sequences is kept as context parallelism
    instead: ``dp`` the largest degree dividing ``samples``, each replica's
    sequences split over ``cp`` ranks that pass keys and values round a ring
    (costed by :func:`block_cost`). Plus ``ep = group_size`` when the block
    holds at least ``group_size`` experts (routing spreads tokens, not
    sequences). Blocks without parameters gain nothing from tensor
    parallelism's weight split: they take ``dp = group_size`` when the samples
    allow it, else ``tp = group_size``, the work split along the hidden or
    sequence axis within a tensor-parallel group (Megatron's sequence
    parallelism), which costs the same. A block with attention takes only
    tensor-parallel degrees that divide its heads (``Block.attention_heads``:
    Megatron-Core splits the query and key-value heads over the ranks); when
    none of those leaves whole sequences, the split is context parallelism.

    >>> [str(m) for m in modes_for(Block(0, "attn", (), (), flops=1.0, param_count=10), 4)]
    ['dp4', 'tp2.dp2', 'tp4']
    >>> [str(m) for m in modes_for(Block(0, "attn", (), (), flops=1.0, param_count=10), 4, samples=2)]
    ['tp2.dp2', 'tp4']
    >>> [str(m) for m in modes_for(Block(0, "attn", (), (), flops=1.0, param_count=10), 8, samples=2, context=True)]
    ['cp4.dp2', 'tp2.cp2.dp2', 'tp4.dp2', 'tp8']
    >>> [str(m) for m in modes_for(Block(0, "norm", (), (), flops=1.0), 4, samples=1)]
    ['tp4']
    >>> [str(m) for m in modes_for(Block(0, "attn", (), (), flops=1.0, param_count=10, attention_heads=6), 4)]
    ['dp4', 'tp2.dp2']
    >>> [str(m) for m in modes_for(Block(0, "core", (), (), flops=1.0, attention_heads=6), 4, samples=2, context=True)]
    ['cp2.dp2', 'tp2.dp2']
    >>> [str(m) for m in modes_for(Block(0, "attn", (), (), flops=1.0, param_count=10, attention_heads=6), 4, samples=1)]
    ['cp4', 'tp2.cp2']
    """
    if group_size < 1:
        raise OpschedError(f"group size must be at least 1, got {group_size}")

    def whole(dp: int) -> bool:
        return samples is None or samples % dp == 0

    def splits_heads(tp: int) -> bool:
        return not block.attention_heads or block.attention_heads % tp == 0

    if block.param_count <= 0 and (whole(group_size) or splits_heads(group_size)):
        return [Mode(dp=group_size) if whole(group_size) else Mode(tp=group_size)]
    # an attention core whose heads do not split group_size ways takes the splits below, as a layer does
    modes = []
    for t in divisors(group_size):
        if not splits_heads(t):
            continue
        rest = group_size // t
        if whole(rest):
            modes.append(Mode(tp=t, dp=rest))
        elif context:
            dp = math.gcd(rest, samples)
            modes.append(Mode(tp=t, cp=rest // dp, dp=dp))
    if not modes:  # no tensor-parallel degree both splits the heads and leaves replicas whole sequences
        return modes_for(block, group_size, samples, context=True)
    if group_size > 1 and expert_count(block) >= group_size:
        modes.append(Mode(ep=group_size))
    return modes


def compute_time(block: Block, share: int, cluster: Cluster, dtype: str, attention: str = "fused") -> float:
    """One device's time for ``1/share`` of a block's operators: a roofline per kind of operator, summed.

    Matrix multiplies run at the cluster's matmul efficiency, fused attention
    at its attention efficiency, and the rest (norms, activations, residual
    adds, ...) at the general efficiency; each kind takes the slower of its
    FLOPs and its memory traffic (at ``memory_efficiency`` of the bandwidth),
    and the kinds run one after another (the presets set each kind's
    efficiency: docs/cost-model.md). A cluster without efficiencies by kind
    costs the block as one roofline at its efficiency, and so does a block
    whose operators carry no kind (a hand-made Block).
    Either way, matrix multiplies are charged their tile-padded FLOPs
    (:mod:`opsched.model.gemm`), and attention runs at the BF16 rate under FP8
    (:meth:`opsched.cost.cluster.Cluster.attention_flops_per_second`). With
    ``attention="unfused"``, a fused ``Attention`` op is costed as the
    unfused kernels it stands for instead (:func:`unfused_attention_time`).

    >>> from opsched.cost.cluster import cluster_from_dict, preset
    >>> c = cluster_from_dict({"preset": "h100-sxm", "devices": 8, "matmul_efficiency": {"bf16": 0.801}})
    >>> b = Block(0, "mlp", (), (), flops=2 * 792.1e12, matmul_flops=792.1e12)
    >>> round(compute_time(b, 1, c, "bf16"), 3)   # 1 s of matmul at 0.801 of 989e12, 792.1e12 FLOPs at 0.5
    2.602
    >>> att = Block(0, "attn", (), (), flops=989e12, attention_flops=989e12)
    >>> h100 = preset("h100-sxm")
    >>> compute_time(att, 1, h100, "fp8") == 989e12 / (h100.attention_efficiency * 989e12)  # BF16, not FP8, peak
    True
    """
    padding = max(0.0, block.matmul_padded_flops - block.matmul_flops)  # 0 for a block without padded FLOPs
    attention_rate = cluster.attention_flops_per_second(dtype)
    if attention == "unfused" and block.attention_scores > 0:
        # the attention ops leave the roofline below and are costed as their unfused kernels
        rest = dataclasses.replace(block, flops=block.flops - block.attention_flops,
                                   io_bytes=block.io_bytes - block.attention_io_bytes, attention_flops=0.0,
                                   attention_io_bytes=0.0, attention_scores=0.0)
        return compute_time(rest, share, cluster, dtype) + unfused_attention_time(block, share, cluster, dtype)
    if not cluster.costs_by_kind:
        flop_time = ((block.flops - block.attention_flops + padding) / cluster.flops_per_second(dtype)
                     + block.attention_flops / attention_rate)
        return max(flop_time / share, block.io_bytes / share / cluster.memory_bandwidth)
    bandwidth = cluster.memory_bandwidth * cluster.memory_efficiency
    rest_flops = max(0.0, block.flops - block.matmul_flops - block.attention_flops)
    rest_io = max(0.0, block.io_bytes - block.matmul_io_bytes - block.attention_io_bytes)
    return (
        max((block.matmul_flops + padding) / share / cluster.matmul_flops_per_second(dtype),
            block.matmul_io_bytes / share / bandwidth)
        + max(block.attention_flops / share / attention_rate, block.attention_io_bytes / share / bandwidth)
        + max(rest_flops / share / cluster.flops_per_second(dtype), rest_io / share / bandwidth)
    )


def score_element_bytes(dtype: str) -> int:
    """Bytes of one attention score, in the precision attention runs in (16 bits under FP8, 4 bytes in FP32)."""
    return DTYPE_BYTES[attention_dtype(dtype)]


def unfused_attention_time(block: Block, share: int, cluster: Cluster, dtype: str) -> float:
    """One device's forward time for ``1/share`` of the block's fused ``Attention`` ops run unfused.

    Megatron-LM's attention before FlashAttention (``CoreAttention``):
    Q·Kᵀ as a batched GEMM writes the scores, a fused scale-mask-softmax reads
    and writes them, dropout (Megatron's default ``--attention-dropout 0.1``)
    reads them and writes its output and a one-byte mask, and scores·V as a
    batched GEMM reads that output: ``6e + 1`` bytes per score element of
    ``e`` bytes (13 in 16 bits; Korthikanti et al. 2022, section 4.1, count
    the same tensors among the activations). The two GEMMs run at the matmul
    ceiling on their tile-padded FLOPs (a head dimension of 96 fills 3/4 of a
    128-wide tile); the softmax's 6 FLOPs per score and the traffic (scores,
    plus the op's own inputs and output) are one roofline at the memory
    efficiency. The backward, as for every operator, costs the forward twice.

    >>> from opsched.cost.cluster import preset
    >>> c = preset("a100-80g")
    >>> b = Block(0, "attn", (), (), flops=8.0, attention_flops=8.0, attention_scores=1e9,
    ...           attention_gemm_padded_flops=0.0)
    >>> round(unfused_attention_time(b, 1, c, "bf16") * 1e3, 2)   # 13 GB at 0.8 of 2.039 TB/s
    7.97
    """
    element = score_element_bytes(dtype)
    traffic = block.attention_scores * (6 * element + 1) + block.attention_io_bytes
    # a cluster without efficiencies by kind has matmuls at its one efficiency and memory_efficiency 1
    gemm_rate = cluster.matmul_flops_per_second(cluster.attention_compute_dtype(dtype))
    bandwidth = cluster.memory_bandwidth * cluster.memory_efficiency
    return (block.attention_gemm_padded_flops / share / gemm_rate
            + max(6 * block.attention_scores / share / cluster.flops_per_second(dtype), traffic / share / bandwidth))


def unfused_kept_score_bytes(block: Block, dtype: str) -> float:
    """Bytes an unfused attention keeps for its backward: softmax output, dropout mask and output (``2e + 1`` a score).

    Korthikanti et al. 2022, section 4.1: ``5·a·s²·b`` bytes per layer in 16 bits.

    >>> unfused_kept_score_bytes(Block(0, "attn", (), (), attention_scores=10.0), "bf16")
    50.0
    """
    return block.attention_scores * (2 * score_element_bytes(dtype) + 1)


def tensor_parallel_bytes(block: Block, token_bytes: float | None = None) -> float:
    """Bytes the block's tensor-parallel all-reduces move per microbatch (in F, and again in I).

    The outputs of its row-parallel layers (:attr:`opsched.model.graph.OpNode.tp_comm_bytes`:
    attention's output projection, the MLP's down projection, the embedding);
    an expert block without one (its output is merged by routing, not by a
    residual Add) reduces the tokens it receives, ``token_bytes``.

    >>> tensor_parallel_bytes(Block(0, "layer", (), (), param_count=9, tp_comm_bytes=2 * 33.5e6)) / 1e6
    67.0
    >>> tensor_parallel_bytes(Block(0, "experts.3", (), ("l0/experts.3/w2",), param_count=9), token_bytes=8e6)
    8000000.0
    """
    if block.tp_comm_bytes > 0:
        return block.tp_comm_bytes
    return float(token_bytes or 0.0) if expert_count(block) > 0 else 0.0


def held_param_bytes(params: float, replicas: int, training: Training, zero: int = 0) -> float:
    """Memory for ``params`` parameters on one device of ``replicas`` holding the same ones, under ZeRO level ``zero``.

    Weight + gradient + optimizer state per parameter (``training``'s bytes);
    ZeRO (Rajbhandari et al. 2020) shards the optimizer states over the
    replicas from level 1 (Megatron's distributed optimizer), the gradients
    from level 2 and the weights at level 3 (FSDP's full shard).

    >>> t = Training()   # 2 + 2 + 12 bytes per parameter
    >>> held_param_bytes(1e9, 8, t) / 1e9, held_param_bytes(1e9, 8, t, zero=1) / 1e9
    (16.0, 5.5)
    >>> held_param_bytes(1e9, 8, t, zero=3) / 1e9
    2.0
    """
    if zero not in ZERO_LEVELS:
        raise OpschedError(f"ZeRO level must be one of {', '.join(map(str, ZERO_LEVELS))}, got {zero}")
    shard = max(1, replicas)
    optimizer = training.optimizer_bytes / (shard if zero >= 1 else 1)
    grad = training.grad_bytes / (shard if zero >= 2 else 1)
    weight = training.param_bytes / (shard if zero >= 3 else 1)
    return params * (weight + grad + optimizer)


def roofline_time(flops: float, io_bytes: float, cluster: Cluster, dtype: str) -> float:
    """The slower of compute and memory traffic on one device."""
    return max(flops / cluster.flops_per_second(dtype), io_bytes / cluster.memory_bandwidth)


def block_cost(
    block: Block,
    mode: Mode,
    devices: tuple[int, ...],
    cluster: Cluster,
    training: Training,
    *,
    expert_params: float | None = None,
    token_bytes: float | None = None,
    moe_layers: int = 1,
) -> BlockCost:
    """Cost of one block on the device group ``devices`` under ``mode``.

    Ranks are laid out tensor-parallel innermost: the tp ranks of a replica
    are consecutive devices (they talk most), replicas are strided by tp.
    For the expert-parallel mode, ``expert_params`` says how many of the
    block's parameters belong to experts (default: all); the rest (attention,
    router) runs data-parallel over the group, replicated and gradient-synced.
    ``token_bytes`` is the size of the tokens an all-to-all moves (default:
    the block's output bytes, an upper bound), over the ``moe_layers`` MoE
    layers the block holds, each of which dispatches and combines once.

    >>> from opsched.cost.cluster import preset, Training
    >>> c, t = preset("h100-sxm"), Training()
    >>> b = Block(0, "mlp", (), (), flops=989e12, param_count=1000)
    >>> block_cost(b, Mode(), (0,), c, t).F
    2.0

    A mode that splits sequences pays ring attention's K/V exchange
    (:func:`sequence_ring`, the rule ``opsched evaluate``'s layouts use): a
    context-parallel mode (``cp > 1``) over its cp ranks, and the expert-parallel
    mode over the ranks its replicated part (attention) splits each sequence
    into when the microbatch's ``training.microbatch_size`` sequences do not
    divide among its ``ep`` ranks.
    """
    if mode.size != len(devices):
        raise OpschedError(f"mode {mode} needs {mode.size} devices, the group has {len(devices)}")
    extra = dict(expert_params=expert_params, token_bytes=token_bytes, moe_layers=moe_layers)
    if mode.cp > 1:
        # dp replicas each split their sequences over cp ranks: compute, memory and gradient sync as dp·cp replicas
        # (Megatron reduces gradients and shards the optimizer over dp x cp), plus the K/V ring of the cp ranks
        cost = block_cost(block, Mode(tp=mode.tp, dp=mode.cp * mode.dp), devices, cluster, training, **extra)
        ring = sequence_ring(block, mode.tp, mode.cp, mode.size, devices[: mode.tp * mode.cp : mode.tp], cluster,
                             training)
        return with_context_ring(cost, ring, training.recompute)[0]
    cost = _block_cost(block, mode, devices, cluster, training, **extra)
    split = mode.ep // math.gcd(mode.ep, training.microbatch_size)
    if split > 1:  # the replicated part of an expert-parallel block runs data-parallel over the ep ranks
        ring = sequence_ring(block, 1, split, mode.ep, devices[:split], cluster, training)
        return with_context_ring(cost, ring, training.recompute)[0]
    return cost


def sequence_ring(block: Block, tp: int, cp: int, ranks: int, ring: Sequence[int], cluster: Cluster,
                  training: Training) -> RingExchange:
    """Ring attention's K/V exchange (:func:`context_ring_time`) of ``block`` split over ``ranks`` devices, each
    sequence over the ``cp`` devices ``ring`` (the first tensor rank of each), heads over ``tp``: each device
    holds ``1/ranks`` of the microbatch's keys and values and overlaps each ring step with its attention.

    >>> from opsched.cost.cluster import preset
    >>> b = Block(0, "attn", (), (), attention_kv_bytes=8e9, attention_flops=4e15)
    >>> r = sequence_ring(b, 1, 4, 8, (0, 1, 2, 3), preset("h100-sxm"), Training())
    >>> r.total_forward == 3 * (5e-6 + 8e9 / 8 / 450e9)   # 3 steps of 1/8 of the bytes over NVLink
    True
    """
    attention = attention_core_time(block, ranks, cluster, training.dtype, training.attention)
    bw, lat = cluster.link(tuple(ring), tuple(ring))
    # context_ring_time divides the keys and values by tp·cp: this device's share of them is 1/ranks
    share = dataclasses.replace(block, attention_kv_bytes=block.attention_kv_bytes * tp * cp / ranks)
    return context_ring_time(share, tp, cp, attention, bw, lat)


def with_context_ring(cost: BlockCost, ring: RingExchange, recompute: str) -> tuple[BlockCost, float]:
    """(``cost`` with the exposed part of its K/V ring, that exposed time per microbatch): the forward's in F, the
    backward's in I, and the forward's again in I when the forward runs again there (recomputation); in the
    passes' communication too, but for a full recomputation's rerun forward, which carries its own.

    >>> r = RingExchange(forward=1.0, backward=2.0, total_forward=3.0, total_backward=4.0)
    >>> c, exposed = with_context_ring(BlockCost(F=1, I=1, W=1, param_bytes=0, act_bytes=0, act_w_bytes=0), r, "full")
    >>> (c.F, c.I, c.f_comm, c.i_comm, exposed)
    (2.0, 4.0, 1.0, 3.0, 4.0)
    """
    again = recompute != "none"  # a recomputed attention forward passes the keys and values round again
    exposed = ring.forward + ring.backward + (ring.forward if again else 0.0)
    return dataclasses.replace(
        cost, F=cost.F + ring.forward, I=cost.I + ring.backward + (ring.forward if again else 0.0),
        f_comm=cost.f_comm + ring.forward,
        i_comm=cost.i_comm + ring.backward + (ring.forward if again and not cost.rerun_forward else 0.0),
    ), exposed


def _block_cost(block: Block, mode: Mode, devices: tuple[int, ...], cluster: Cluster, training: Training, *,
                expert_params: float | None, token_bytes: float | None, moe_layers: int) -> BlockCost:
    """:func:`block_cost` of a mode that splits no sequence (its replicas take whole sequences)."""
    share = mode.size  # every mode splits a microbatch's compute over the whole group
    compute = compute_time(block, share, cluster, training.dtype, training.attention)
    has_weights = block.param_count > 0
    f = i = compute
    w = compute if has_weights else 0.0
    tp_comm = ep_comm = 0.0
    if mode.tp > 1 and has_weights:
        # Megatron's scheme: an all-reduce after each row-parallel layer in F, and the same in I
        bw, lat = cluster.link(devices[: mode.tp], devices[: mode.tp])
        tp_comm = allreduce_time(tensor_parallel_bytes(block, token_bytes) / mode.dp, mode.tp, bw, lat)
        f, i = f + tp_comm, i + tp_comm
    sync = 0.0
    param_bytes = held_param_bytes(block.param_count / mode.tp, mode.dp, training, training.zero)
    if mode.ep > 1:
        # dispatch and combine: two all-to-alls of the tokens in F, two in I
        bw, lat = cluster.link(devices, devices)
        tokens = block.output_bytes if token_bytes is None else token_bytes
        # each peer's share over the link that reaches it (the planner's mode and evaluate's layouts alike)
        nodes = len({cluster.node_of(d) for d in devices})
        ep_comm = 2 * spread_alltoall_time(tokens / mode.ep, mode.ep, nodes,
                                           (cluster.intra_node_bandwidth, cluster.intra_node_latency * moe_layers),
                                           (cluster.inter_node_bandwidth, cluster.inter_node_latency * moe_layers))
        f += ep_comm
        i += ep_comm
        sharded = block.param_count if expert_params is None else min(float(expert_params), block.param_count)
        replicated = block.param_count - sharded
        # each expert lives on one device; the rest is replicated over the ep devices
        param_bytes = (held_param_bytes(sharded / mode.ep, 1, training, training.zero)
                       + held_param_bytes(replicated, mode.ep, training, training.zero))
        sync = allreduce_time(replicated * training.grad_bytes, mode.ep, bw, lat)
    if mode.dp > 1 and has_weights:
        replicas = devices[:: mode.tp]
        bw, lat = cluster.link(replicas, replicas)
        sync = allreduce_time(block.param_count / mode.tp * training.grad_bytes, mode.dp, bw, lat)
    act = stored_activation_bytes(block, mode, training.sequence_parallel) - fp8_cached_saving(block, share, training)
    # the weight gradient needs the inputs of the weight matmuls: about half the saved tensors
    act_w = act / 2 if has_weights else 0.0
    # an unfused attention keeps its scores for the backward too (a fused one recomputes them inside its kernel)
    kept_scores = unfused_kept_score_bytes(block, training.dtype) / share if training.attention == "unfused" else 0.0
    act += kept_scores
    if training.recompute == "selective":
        # Korthikanti et al. 2022 section 5: the attention core's forward runs again before its backward; its
        # scores (QK^T, softmax, dropout) are not stored (a fused Attention op never writes them)
        i += attention_core_time(block, share, cluster, training.dtype, training.attention)
        act = max(0.0, act - block.attention_scores_bytes / share - kept_scores)
        act_w = min(act_w, act)
    if training.recompute_modules:
        f_again, saved = recomputed_parts(block, parts_of(training.recompute_modules), share, cluster, training)
        i += f_again
        act = max(0.0, act - saved)
        act_w = min(act_w, act)
    if training.recompute == "full":
        # Megatron's full recomputation: keep only the block's input, run its forward again before I; the input
        # is the residual stream, held whole by every tensor-parallel rank unless sequence parallelism splits it
        i += f
        whole = share if training.sequence_parallel else share // mode.tp
        kept = (block.output_bytes if token_bytes is None else token_bytes) / whole
        act, act_w = min(act, kept), min(act_w, kept)
    cost = BlockCost(F=f, I=i, W=w, param_bytes=param_bytes, act_bytes=act, act_w_bytes=act_w, grad_sync=sync,
                     f_comm=tp_comm + ep_comm, i_comm=tp_comm + ep_comm, rerun_forward=training.recompute == "full")
    hidden = tp_comm > 0 and training.tp_comm_overlap and training.sequence_parallel  # Megatron asserts sp with it
    return tp_comm_overlapped(cost, others=ep_comm) if hidden else cost


def recomputed_parts(block: Block, parts: frozenset[str], share: int, cluster: Cluster,
                     training: Training) -> tuple[float, float]:
    """(forward time run again, saved bytes not stored) for ``1/share`` of ``block``'s operators in ``parts``
    (Megatron's recompute modules: :mod:`opsched.model.recompute_modules`).

    >>> from opsched.cost.cluster import preset, Training
    >>> from opsched.model.recompute_modules import PartCost
    >>> b = Block(0, "attn", (), (), parts=(PartCost("layernorm", 0.0, 0.0, 0.0, 2.7e12, 0.0, 0.0, 0.0, 8.0),))
    >>> again, saved = recomputed_parts(b, frozenset({"layernorm"}), 2, preset("h100-sxm"), Training())
    >>> round(again, 3), saved   # half the norm's traffic at 0.9 of 3.35 TB/s again; half its saved bytes kept no more
    (0.448, 4.0)
    """
    again = saved = 0.0
    for p in block.parts:
        if p.part in parts:
            sub = Block(block.id, block.name, block.scope, (), flops=p.flops, matmul_flops=p.matmul_flops,
                        matmul_padded_flops=p.matmul_padded_flops, io_bytes=p.io_bytes,
                        matmul_io_bytes=p.matmul_io_bytes, attention_flops=p.attention_flops,
                        attention_io_bytes=p.attention_io_bytes)
            again += compute_time(sub, share, cluster, training.dtype, training.attention)
            # what the part kept, as it kept it: its linear layers' inputs in FP8 under --dtype fp8; less what its
            # recomputation keeps to run it again (a MoE activation's inputs: in FP8 under --dtype fp8, as
            # DeepSeek-V3 caches the SwiGLU's inputs, arXiv 2412.19437 §3.3.3)
            fp8 = training.dtype == "fp8"
            kept, kept_fp8 = kept_for_recompute(p, parts)
            saved += (p.saved_bytes - p.fp8_input_saving * fp8 - (kept - kept_fp8 * fp8)) / share
    return again, saved


def fp8_cached_saving(block: Block, share: int, training: Training) -> float:
    """Bytes one of ``share`` devices does not store of ``block``'s saved activations when its linear layers run in
    FP8 (``training.dtype`` fp8): their inputs are kept cast to FP8, one byte an element
    (:attr:`opsched.model.graph.OpNode.fp8_input_saving`; Transformer Engine's ``Linear`` keeps the quantized input
    for its weight-gradient GEMM, NVIDIA/TransformerEngine ``transformer_engine/pytorch/module/linear.py``;
    DeepSeek-V3 caches the inputs of its FP8 linear layers in FP8, arXiv 2412.19437 §3.3). 0 in any other dtype.

    >>> from opsched.cost.cluster import Training
    >>> b = Block(0, "mlp", (), (), saved_bytes=40.0, fp8_input_saving=16.0)
    >>> fp8_cached_saving(b, 2, Training(dtype="fp8")), fp8_cached_saving(b, 2, Training())
    (8.0, 0.0)
    """
    return block.fp8_input_saving / share if training.dtype == "fp8" else 0.0


def stored_activation_bytes(block: Block, mode: Mode, sequence_parallel: bool = True) -> float:
    """Bytes one device stores from the block's forward for its backward, per microbatch (no recomputation).

    What the block's operators keep for the backward (``saved_bytes``,
    :mod:`opsched.model.saved`), split over the mode's devices, except that without
    sequence parallelism a tensor-parallel rank holds whole what lies outside
    the column-/row-parallel pairs (``tp_replicated_bytes``: the norms' inputs
    and outputs): Korthikanti et al. 2022, Table 2, ``sbh(10 + 24/t)``
    without and ``34·sbh/t`` with it (their counts include two dropout masks
    of ``sbh`` each).

    >>> b = Block(0, "layer", (), (), param_count=9, saved_bytes=34.0, tp_replicated_bytes=10.0)
    >>> stored_activation_bytes(b, Mode(tp=2)), stored_activation_bytes(b, Mode(tp=2), sequence_parallel=False)
    (17.0, 22.0)
    """
    split = block.saved_bytes - block.tp_replicated_bytes
    replicated_over = mode.size if sequence_parallel or mode.tp == 1 else mode.size // mode.tp
    return split / mode.size + block.tp_replicated_bytes / replicated_over


def attention_core_time(block: Block, share: int, cluster: Cluster, dtype: str, attention: str = "fused") -> float:
    """One device's forward time for ``1/share`` of the block's attention core (what selective recomputation repeats).

    The attention operators' part of :func:`compute_time`: their FLOPs and
    traffic at the attention efficiency, or at the cluster's one efficiency
    when it sets none by kind.

    >>> from opsched.cost.cluster import cluster_from_dict
    >>> c = cluster_from_dict({"preset": "h100-sxm", "devices": 8, "attention_efficiency": 0.5})
    >>> b = Block(0, "attn", (), (), flops=3 * 989e12, attention_flops=989e12 / 2)
    >>> attention_core_time(b, 1, c, "bf16")   # half a second of peak at 0.5 efficiency
    1.0
    """
    if block.attention_flops <= 0 and block.attention_io_bytes <= 0:
        return 0.0
    core = Block(block.id, block.name, block.scope, (), flops=block.attention_flops,
                 io_bytes=block.attention_io_bytes, attention_flops=block.attention_flops,
                 attention_io_bytes=block.attention_io_bytes, attention_scores=block.attention_scores,
                 attention_gemm_padded_flops=block.attention_gemm_padded_flops)
    return compute_time(core, share, cluster, dtype, attention)
