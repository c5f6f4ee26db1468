"""One device's share of a pipeline chunk under a Megatron-style layout: the cost half of :mod:`opsched.plan.layouts`.

A pipeline rank's device groups (:class:`RankGroups`: tensor, context, expert and weight-replica ranks in
Megatron's order), and what one device pays for each block of a chunk on that rank (:func:`_block_share`:
its passes with the layout's tensor, context and expert communication, the parameter state it holds, its
gradient sync and optimizer step), summed per chunk by :func:`_chunk_cost`. The blocks' shares are kept on
the :class:`opsched.plan.layouts.ModelIndex` by cost class, so each is found once per setting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import networkx as nx

from opsched.cost.cluster import Cluster, Training
from opsched.cost.blocks import (BlockCost, Mode, attention_core_time, block_cost, held_param_bytes,
                                 joined_streams, with_context_ring)
from opsched.cost.collectives import (allreduce_time, context_ring_time, node_limited_alltoall_time,
                                      spread_alltoall_time)
from opsched.model.graph import Block
from opsched.cost.overlap import PassStreams
from opsched.cost.parallel_layout import ParallelLayout

if TYPE_CHECKING:
    from opsched.plan.layouts import ModelIndex


@dataclass(frozen=True)
class RankGroups:
    """The device groups of one pipeline rank's first ranks (tp innermost, then cp, then dp: Megatron's order)."""

    tensor: tuple[int, ...]  # the tensor-parallel ranks of the first context rank of the first replica
    context: tuple[int, ...]  # the first tensor rank of each context-parallel rank of the first replica
    expert: tuple[int, ...]  # the ep ranks that swap routed tokens (stride etp: expert tensor ranks innermost)
    expert_weights: tuple[int, ...]  # the ranks holding the same experts: stride ep x etp
    sequence: tuple[int, ...]  # every rank splitting one microbatch: tp x cp of the first replica
    weights: tuple[int, ...]  # the first tensor rank of every rank holding the same weights: cp x dp


def _rank_devices(layout: ParallelLayout, devices: int, rank: int) -> RankGroups:
    """The :class:`RankGroups` of pipeline rank ``rank``.

    >>> _rank_devices(ParallelLayout(tp=2, pp=2, cp=2, dp=2), 16, 1).context
    (8, 10)
    """
    base = rank * (devices // layout.pp)
    replica = layout.tp * layout.cp
    etp = layout.etp or layout.tp
    expert_grid = layout.ep * etp
    return RankGroups(
        tensor=tuple(range(base, base + layout.tp)),
        context=tuple(base + k * layout.tp for k in range(layout.cp)),
        # Megatron-Core's expert rank order (parallel folding): expert tensor ranks innermost, then ep, then the
        # expert data-parallel replicas, over the pipeline rank's tp x cp x dp devices
        expert=tuple(base + j * etp for j in range(layout.ep)),
        expert_weights=tuple(base + k * expert_grid for k in range(replica * layout.dp // expert_grid)),
        sequence=tuple(range(base, base + replica)),
        weights=tuple(base + k * layout.tp for k in range(layout.cp * layout.dp)),
    )


@dataclass
class _ChunkCost:
    F: float = 0.0
    I: float = 0.0  # noqa: E741 (the pass is called I)
    W: float = 0.0
    param_bytes: float = 0.0
    act_bytes: float = 0.0
    act_w_bytes: float = 0.0
    grad_sync: float = 0.0
    optimizer: float = 0.0
    context_ring: float = 0.0  # exposed K/V ring time per microbatch, in F and I (part of them)
    comm: float = 0.0  # communication in F and I per microbatch (part of them): what an overlapped pair may hide
    streams: PassStreams | None = None  # the passes' compute and communication operations


def _block_shard(block: Block, expert: bool, layout: ParallelLayout) -> tuple[float, int]:
    """(parameters one device holds of ``block``, replicas holding the same ones: what ZeRO shards over).

    Experts on the ep x etp grid carved out of a pipeline rank's tp x cp x dp devices (parallel folding): each
    device holds 1/(ep x etp) of them, the same as tp x cp x dp / (ep x etp) others.
    """
    if expert:
        grid = layout.ep * (layout.etp or layout.tp)
        return block.param_count / grid, layout.tp * layout.cp * layout.dp // grid
    return block.param_count / layout.tp, layout.dp * layout.cp


def _block_held_bytes(block: Block, expert: bool, layout: ParallelLayout, training: Training) -> float:
    """The bytes of parameter state (weights, gradients, optimizer) one device holds of ``block``."""
    params, replicas = _block_shard(block, expert, layout)
    return held_param_bytes(params, replicas, training, layout.zero)


def _chunk_cost(bg: nx.DiGraph, index: ModelIndex, members: list[int], layout: ParallelLayout, cluster: Cluster,
                cluster_key: tuple, training: Training, rank: int, streams: bool = True,
                classes: list[tuple[int, int]] | None = None) -> _ChunkCost:
    """One device's share of a chunk: pass times per microbatch, memory, gradient sync and optimizer step; with
    ``streams``, its passes' stream operations too. ``cluster_key`` is :func:`_cluster_key` of ``cluster``.
    ``classes``: without ``streams``, the chunk's blocks as (a block of each cost class, its count), summed per
    class (:func:`chunk_classes`; a floor over thousands of layouts of a 15,000-block model)."""
    training = dataclasses.replace(training, recompute=layout.recompute, recompute_modules=layout.recomputed_modules,
                                   sequence_parallel=layout.sp,
                                   tp_comm_overlap=layout.tp_overlap, attention=layout.attention)
    groups = _rank_devices(layout, cluster.devices, rank)
    links = _ChunkLinks.of(groups, layout, cluster)
    # what every block's share depends on besides the block: the blocks' shares are kept on the index under it
    setting = ("share", layout.tp, layout.cp, layout.ep, layout.etp, layout.max_nodes, layout.dp, layout.zero, links,
               cluster_key, training)
    shares = index.block_shares.setdefault(setting, {})  # cost class -> its share under this setting
    out = _ChunkCost()
    weights = 0.0  # bytes of this device's share of the chunk's weights, unsharded
    timed: list[PassStreams] = []  # each block's operations with this layout's communication
    for b, n in classes if classes is not None and not streams else ((b, 1) for b in members):
        k = index.cost_class[b]
        share = shares.get(k)
        if share is None:
            share = shares[k] = _block_share(bg.nodes[b]["block"], index.tokens_in[b], index.expert_share[b],
                                             layout, groups, links, cluster, training,
                                             index.routed_copies.get(b, 1.0))
        out.F += n * share.cost.F
        out.I += n * share.cost.I
        out.W += n * share.cost.W
        if streams:
            timed.append(share.streams)
        out.param_bytes += n * share.param_bytes
        weights += n * share.weight_bytes
        out.act_bytes += n * share.cost.act_bytes
        out.act_w_bytes += n * share.cost.act_w_bytes
        out.grad_sync += n * share.grad_sync
        out.optimizer += n * share.optimizer
        out.context_ring += n * share.context_ring
        out.comm += n * (share.cost.f_comm + share.cost.i_comm)
    gather = 0.0
    if layout.zero >= 3:
        # FSDP gathers the weights before use in F and again in I; an all-gather is half a ring all-reduce
        bw, lat = links.weights
        gather = allreduce_time(weights, layout.dp * layout.cp, bw, lat) / 2
        out.F += gather
        out.I += gather
    out.streams = joined_streams(timed, before=gather) if streams else None
    return out


def chunk_classes(index: ModelIndex, members: list[int]) -> list[tuple[int, int]]:
    """(a block of each cost class in ``members``, how many of its blocks are of that class), in first-met order.

    >>> from types import SimpleNamespace
    >>> chunk_classes(SimpleNamespace(cost_class={4: 0, 5: 1, 6: 0}), [4, 5, 6])
    [(4, 2), (5, 1)]
    """
    first: dict[int, int] = {}
    count: dict[int, int] = {}
    for b in members:
        k = index.cost_class[b]
        first.setdefault(k, b)
        count[k] = count.get(k, 0) + 1
    return [(first[k], count[k]) for k in first]


@dataclass(frozen=True)
class _ChunkLinks:
    """(bandwidth, latency) of each group a pipeline rank's blocks talk over: found once per chunk, not per block."""

    tensor: tuple[float, float]  # the tensor-parallel ranks
    sequence_replicas: tuple[float, float]  # the first tensor rank of each context rank (block_cost's replicas)
    context: tuple[float, float]
    weights: tuple[float, float]  # every rank holding the same dense weights
    expert_weights: tuple[float, float]  # the ranks holding the same experts
    expert_nodes: int  # nodes the ep ranks span
    intra_node: tuple[float, float]  # NVLink, for node-limited routing's forwarding within a node
    inter_node: tuple[float, float]

    @classmethod
    def of(cls, groups: RankGroups, layout: ParallelLayout, cluster: Cluster) -> _ChunkLinks:
        def link(group):
            return cluster.link(group, group)

        return cls(link(groups.sequence[: layout.tp]), link(groups.sequence[:: layout.tp]), link(groups.context),
                   link(groups.weights), link(groups.expert_weights),
                   len({cluster.node_of(d) for d in groups.expert}),
                   (cluster.intra_node_bandwidth, cluster.intra_node_latency),
                   (cluster.inter_node_bandwidth, cluster.inter_node_latency))


def _cluster_key(cluster: Cluster) -> tuple:
    """Every field of ``cluster`` but its device count, hashable: what a block's cost depends on besides links."""
    return tuple((f.name, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                 for f in dataclasses.fields(cluster) if f.name != "devices"
                 for v in (getattr(cluster, f.name),))


@dataclass(frozen=True)
class _BlockShare:
    """One device's share of one block under a layout: the terms :func:`_chunk_cost` sums."""

    cost: BlockCost  # with this layout's context ring and expert all-to-alls in F, I and their communication
    streams: PassStreams  # cost's passes as stream operations (BlockCost.streams)
    param_bytes: float  # parameter state held (weights, gradients, optimizer)
    weight_bytes: float  # weights held, unsharded (what ZeRO-3 gathers)
    grad_sync: float
    optimizer: float
    context_ring: float  # exposed K/V ring time per microbatch, in F and I


def _block_share(block: Block, tokens: float, expert_share: float, layout: ParallelLayout, groups: RankGroups,
                 links: _ChunkLinks, cluster: Cluster, training: Training, copies: float = 1.0) -> _BlockShare:
    """One device's share of ``block`` on a pipeline rank whose groups are ``groups`` (``training`` with the
    layout's recomputation, sequence parallelism and tp overlap); ``expert_share``: the share of its MoE layer's
    experts it holds (:attr:`ModelIndex.expert_share`, 0 for a block without experts); ``copies``: the copies
    of each token its layer routes (:attr:`ModelIndex.routed_copies`).

    An expert block runs on the ep x etp grid folded over the pipeline rank's tp x cp x dp devices: a device
    takes 1/(tp x cp) of the microbatch's expert work (the grid's tokens spread evenly), split etp ways by
    tensor parallelism and (tp x cp) / etp ways by tokens, so its collectives are the etp ranks'."""
    expert = expert_share > 0
    layer_cluster = cluster
    if expert:
        # a MoE layer's collectives (its tensor-parallel ones, its dispatch and combine) run once for all its
        # experts, however many blocks they were exported as: each block pays its share of their latency
        layer_cluster = dataclasses.replace(cluster, intra_node_latency=cluster.intra_node_latency * expert_share,
                                            inter_node_latency=cluster.inter_node_latency * expert_share)
        if layout.ep > 1:
            block = _weights_read_once_per_ep(block, layout.ep)
    # a context rank takes 1/cp of each sequence: costed like a replica taking 1/cp of the microbatch
    mode = Mode(tp=layout.tp, dp=layout.cp)
    if expert:
        etp = layout.etp or layout.tp
        mode = Mode(tp=etp, dp=layout.tp * layout.cp // etp)  # on the same tp x cp devices, etp innermost
    c = block_cost(block, mode, groups.sequence, layer_cluster, training, token_bytes=tokens)
    params, replicas = _block_shard(block, expert, layout)
    context_ring = 0.0
    if layout.cp > 1:  # the planner's context-parallel modes pay the same (opsched.cost.blocks.block_cost)
        bw, lat = links.context
        attention = attention_core_time(block, mode.size, cluster, training.dtype, training.attention)
        ring = context_ring_time(block, layout.tp, layout.cp, attention, bw, lat)
        c, context_ring = with_context_ring(c, ring, training.recompute)
    f, i = c.F, c.I
    f_comm, i_comm = c.f_comm, c.i_comm
    if expert and layout.ep > 1:
        # dispatch and combine: the layer's two all-to-alls over the ep ranks, of which this block moves its own
        # routed tokens (each device those of its 1/(tp x cp) of the sequence) and pays its share of the latency
        # (one expert of 256 exported as a block pays 1/256 of it, not all of it)
        routed = tokens / (layout.tp * layout.cp)
        a2a = _expert_alltoall_time(routed * dispatch_precision(training.dtype), copies, layout, links, expert_share) \
            + _expert_alltoall_time(routed, copies, layout, links, expert_share)
        f += a2a
        i += a2a * (2 if training.recompute == "full" else 1)  # a recomputed forward swaps them again
        f_comm += a2a
        i_comm += a2a
    grad_sync = 0.0
    if replicas > 1 and block.param_count > 0:
        # every ep-th replica holds the same experts; all-reduce, or reduce-scatter + all-gather with ZeRO: the
        # same ring volume
        bw, lat = links.expert_weights if expert else links.weights
        grad_sync = allreduce_time(params * training.grad_bytes, replicas, bw, lat)
    updated = params / (replicas if layout.zero >= 1 else 1)
    cost = dataclasses.replace(c, F=f, I=i, f_comm=f_comm, i_comm=i_comm)
    return _BlockShare(cost=cost, streams=cost.streams(),
                       param_bytes=_block_held_bytes(block, expert, layout, training),
                       weight_bytes=params * training.param_bytes, grad_sync=grad_sync,
                       optimizer=updated * training.optimizer_step_bytes / cluster.memory_bandwidth,
                       context_ring=context_ring)


def dispatch_precision(dtype: str) -> float:
    """The dispatch all-to-all's bytes per token over the model's 16-bit activations: DeepSeek-V3 quantizes the
    tokens to FP8 before dispatch (and the activation gradients before the backward's matching all-to-all) and
    keeps combine in BF16 (arXiv 2412.19437 §3.3.3), so with dtype fp8 dispatch moves half the bytes.

    >>> dispatch_precision("fp8"), dispatch_precision("bf16")
    (0.5, 1.0)
    """
    return 0.5 if dtype == "fp8" else 1.0


def _expert_alltoall_time(nbytes: float, copies: float, layout: ParallelLayout, links: _ChunkLinks,
                          latency_share: float) -> float:
    """One all-to-all (dispatch or combine) of ``nbytes`` routed token bytes per device over the ep ranks: each
    peer's share over the link that reaches it (:func:`opsched.cost.collectives.spread_alltoall_time`), or
    node-limited when ``layout.max_nodes`` is set and the ranks span more nodes than that
    (:func:`opsched.cost.collectives.node_limited_alltoall_time`)."""
    if layout.max_nodes and links.expert_nodes > 1:
        bw, lat = links.intra_node
        ib, ib_lat = links.inter_node
        return node_limited_alltoall_time(nbytes, copies, layout.ep, links.expert_nodes, layout.max_nodes,
                                          (bw, lat * latency_share), (ib, ib_lat * latency_share))
    (bw, lat), (ib, ib_lat) = links.intra_node, links.inter_node
    return spread_alltoall_time(nbytes, layout.ep, links.expert_nodes, (bw, lat * latency_share),
                                (ib, ib_lat * latency_share))


def _weights_read_once_per_ep(block: Block, ep: int) -> Block:
    """An expert block as one device of ``ep`` runs it, folded over the replicas: it holds 1/ep of the layer's
    experts and runs each on the tokens ep replicas route to it, the same FLOPs as its own tokens on every
    expert, but each expert's weights are read once for ep times the tokens: 1/ep of the weight traffic.
    Fine-grained experts (DeepSeek-V3: 256, 128 tokens each per sequence of 4,096) are memory-bound alone.

    >>> b = Block(0, "experts.0", (), (), flops=1e9, param_bytes=800.0, io_bytes=1000.0, matmul_io_bytes=900.0)
    >>> e = _weights_read_once_per_ep(b, 8)
    >>> e.io_bytes, e.matmul_io_bytes, e.flops
    (300.0, 200.0, 1000000000.0)
    """
    unread = block.param_bytes * (1 - 1 / ep)
    return dataclasses.replace(block, io_bytes=max(0.0, block.io_bytes - unread),
                               matmul_io_bytes=max(0.0, block.matmul_io_bytes - unread))
