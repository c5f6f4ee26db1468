"""Communication times by the alpha-beta model: the collectives of a parallel mode, context parallelism's K/V
ring, and a transfer between device groups.

Ring all-reduce ``2(k-1)α + 2(k-1)/k · n/β`` and all-to-all ``(k-1)α + (k-1)/k · n/β`` on the slowest link of
the ranks involved (with the variants for all-to-alls spread over nodes and DeepSeek-V3's node-limited routing),
ring attention's exchange overlapped with the attention, and ``α + n/β`` between groups (written out in
``docs/cost-model.md``). :mod:`opsched.cost.blocks` builds a block's cost from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from opsched.cost.cluster import Cluster
from opsched.model.graph import Block


def allreduce_time(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``ranks`` devices: ``2(k-1)α + 2(k-1)/k · n/β``.

    >>> allreduce_time(8.0, 4, bandwidth=1.0, latency=0.5)
    15.0
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * nbytes / bandwidth


def alltoall_time(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """All-to-all of ``nbytes`` held by each device: ``(k-1)α + (k-1)/k · n/β``."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) * latency + (ranks - 1) / ranks * nbytes / bandwidth


def spread_alltoall_time(nbytes: float, ranks: int, nodes: int, intra: tuple[float, float],
                         inter: tuple[float, float]) -> float:
    """All-to-all of ``nbytes`` per device over ``ranks`` devices spread evenly over ``nodes`` nodes: each device
    sends ``1/ranks`` of its bytes to every peer at once, the peers on other nodes through its network link and
    those on its own node over NVLink, the longer of the two plus each hop's latency (on one node,
    :func:`alltoall_time` over NVLink). Across 2 nodes half the bytes leave the node, not 15/16 of them.

    >>> spread_alltoall_time(16.0, 16, 2, (1e9, 0.0), (1.0, 0.0))   # 8 of 16 peers off the node, 1 B/s network
    8.0
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if nodes <= 1:
        return alltoall_time(nbytes, ranks, *intra)
    per_node = max(1, ranks // nodes)
    off_node = nbytes * (ranks - per_node) / ranks
    on_node = nbytes * (per_node - 1) / ranks
    return max(off_node / inter[0], on_node / intra[0]) + (nodes - 1) * inter[1] + (per_node - 1) * intra[1]


def node_limited_alltoall_time(nbytes: float, copies: float, ranks: int, nodes: int, max_nodes: int,
                                intra: tuple[float, float], inter: tuple[float, float]) -> float:
    """Dispatch (or combine) of ``nbytes`` of routed token copies per device over ``ranks`` expert ranks on
    ``nodes`` nodes, each token sent to at most ``max_nodes`` nodes (DeepSeek-V3's node-limited routing,
    arXiv 2412.19437 §2.1.2 and §3.2.2): a token crosses InfiniBand once per chosen remote node, however many
    of its ``copies`` (top-k, with the capacity factor) go to experts there, and NVLink forwards the copies to
    their experts within the node, the two pipelined: the longer of the two, plus each hop's latency.
    ``intra`` / ``inter``: (bandwidth, latency) of NVLink and of the network.

    With 8 nodes, 4 of them per token and 8 copies, InfiniBand carries 4 x 7/8 = 3.5 token copies, not 7:

    >>> round(node_limited_alltoall_time(8.0, 8, 64, 8, 4, (1e9, 0.0), (1.0, 0.0)), 3)
    3.5
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    per_node = max(1, ranks // nodes)
    chosen = min(max_nodes, nodes, copies)  # nodes a token goes to
    over_network = nbytes / copies * chosen * (nodes - 1) / nodes
    within_node = nbytes * (per_node - 1) / per_node
    return max(over_network / inter[0], within_node / intra[0]) + (nodes - 1) * inter[1] + \
        (per_node - 1) * intra[1]


@dataclass(frozen=True)
class RingExchange:
    """Context parallelism's key/value ring for one block and microbatch, on one device (s).

    ``forward`` / ``backward``: what is left exposed after overlapping each
    ring step with the attention computed on the keys and values already
    held; ``total_*``: the transfers themselves.
    """

    forward: float
    backward: float
    total_forward: float
    total_backward: float


def context_ring_time(block: Block, tp: int, cp: int, attention_time: float, bandwidth: float,
                      latency: float) -> RingExchange:
    """Ring attention's K/V exchange over ``cp`` context-parallel ranks (Liu et al. 2023; Megatron-Core's CP).

    Each rank holds ``1/cp`` of the sequence and ``1/tp`` of the heads, so
    ``n = attention_kv_bytes / (tp·cp)`` bytes of keys and values; the
    forward passes them ``cp - 1`` times round the ring, each step a
    point-to-point ``α + n/β`` overlapped with the attention of one chunk
    (``attention_time / cp``, ``attention_time`` being the rank's whole
    attention forward); the backward passes keys, values and their
    gradients (``2n``) against the same attention time (opsched's backward
    costs a pass like the forward). Only the part of each step the
    attention does not hide is exposed.

    >>> b = Block(0, "attn", (), (), attention_kv_bytes=8e9)
    >>> r = context_ring_time(b, tp=1, cp=4, attention_time=4.0, bandwidth=1e9, latency=0.0)
    >>> r.total_forward, r.forward, r.backward   # 3 steps of 2 s against 1 s of attention each; then 4 s each
    (6.0, 3.0, 9.0)
    """
    if cp <= 1 or block.attention_kv_bytes <= 0:
        return RingExchange(0.0, 0.0, 0.0, 0.0)
    n = block.attention_kv_bytes / (tp * cp)
    per_chunk = attention_time / cp
    step_f, step_b = latency + n / bandwidth, latency + 2 * n / bandwidth
    return RingExchange(forward=(cp - 1) * max(0.0, step_f - per_chunk),
                        backward=(cp - 1) * max(0.0, step_b - per_chunk),
                        total_forward=(cp - 1) * step_f, total_backward=(cp - 1) * step_b)


def transfer_time(nbytes: float, cluster: Cluster, src: tuple[int, ...], dst: tuple[int, ...]) -> float:
    """Time to send ``nbytes`` of activations from group ``src`` to group ``dst``: ``α + n/β``.

    Zero when both are the same group (the tensor stays in memory) or nothing
    is sent. Intra-node link when both groups sit on one node, else inter-node.
    """
    if nbytes <= 0 or tuple(src) == tuple(dst):
        return 0.0
    bw, lat = cluster.link(tuple(src), tuple(dst))
    return lat + nbytes / bw
