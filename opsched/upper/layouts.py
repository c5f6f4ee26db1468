"""Group layouts: how the devices are cut into groups and the groups into pipeline slots.

A :class:`Layout` cuts ``N`` devices into ``G`` groups of ``k = N / G``
consecutive devices and gives each group ``v`` virtual stages, so there are
``S = G·v`` ordered **slots**. Slot ``s`` runs on group ``g(s)``:

* ``chain`` (v = 1): ``g(s) = s``;
* ``v`` (v = 2, Zero Bubble V / DualPipeV shape): ``g(s) = s`` for ``s < G``,
  else ``2G - 1 - s``;
* ``interleaved`` (Megatron): ``g(s) = s mod G``.

Blocks never flow back to an earlier slot, so the stages form a DAG; two
mutually unreachable blocks may take different slots (groups) and run at the
same time.

>>> lay = Layout(devices=8, groups=4, virtual=2, placement="v")
>>> [lay.group_of_slot(s) for s in range(lay.slots)]
[0, 1, 2, 3, 3, 2, 1, 0]
>>> lay.devices_of_group(1)
(2, 3)
"""

from __future__ import annotations

from dataclasses import dataclass

from opsched.cluster import Cluster
from opsched.cost import divisors
from opsched.errors import OpschedError
from opsched.schedule import v_device

PLACEMENTS = ("chain", "v", "interleaved")


@dataclass(frozen=True)
class Layout:
    """``groups`` groups of ``devices / groups`` devices, ``virtual`` slots per group."""

    devices: int
    groups: int
    virtual: int = 1
    placement: str = "chain"

    def __post_init__(self) -> None:
        if self.groups < 1 or self.devices % self.groups:
            raise OpschedError(f"{self.devices} devices cannot be cut into {self.groups} equal groups")
        if self.placement not in PLACEMENTS:
            raise OpschedError(f"unknown placement {self.placement!r}; choose {', '.join(PLACEMENTS)}")
        if (self.virtual == 1) != (self.placement == "chain"):
            raise OpschedError("placement chain goes with 1 virtual stage per group; v and interleaved with 2 or more")
        if self.placement == "v" and self.virtual != 2:
            raise OpschedError("placement v needs exactly 2 virtual stages per group")

    @property
    def group_size(self) -> int:
        return self.devices // self.groups

    @property
    def slots(self) -> int:
        return self.groups * self.virtual

    def group_of_slot(self, slot: int) -> int:
        if self.placement == "v":
            return v_device(slot, self.groups)
        return slot % self.groups

    def slots_of_group(self, group: int) -> list[int]:
        return [s for s in range(self.slots) if self.group_of_slot(s) == group]

    def devices_of_group(self, group: int) -> tuple[int, ...]:
        k = self.group_size
        return tuple(range(group * k, (group + 1) * k))

    def __str__(self) -> str:
        text = f"{self.groups}x{self.group_size}"
        return text if self.virtual == 1 else f"{text} {self.placement} v={self.virtual}"


def layouts(cluster: Cluster, max_virtual: int = 2) -> list[Layout]:
    """Every layout of the cluster's devices: G over the divisors of N, v in 1..max_virtual.

    A group must not straddle a node boundary unevenly: its size divides the
    devices per node or is a whole number of nodes. Raises
    :class:`OpschedError` when the devices do not fill whole nodes.

    >>> from opsched.cluster import preset
    >>> [str(l) for l in layouts(preset("h100-sxm", 2))]
    ['1x2', '2x1', '2x1 v v=2', '2x1 interleaved v=2']
    """
    n, per_node = cluster.devices, cluster.devices_per_node
    if n < 1:
        raise OpschedError(f"devices must be at least 1, got {n}")
    if n > per_node and n % per_node:
        raise OpschedError(
            f"{n} devices do not fill whole nodes of {per_node}; use a multiple of {per_node} "
            "or a --cluster file with a matching devices_per_node"
        )
    out = []
    for g in divisors(n):
        k = n // g
        if per_node % k and k % per_node:
            continue
        out.append(Layout(n, g))
        if g >= 2:
            for v in range(2, max_virtual + 1):
                if v == 2:
                    out.append(Layout(n, g, 2, "v"))
                out.append(Layout(n, g, v, "interleaved"))
    if not out:
        raise OpschedError(f"{n} devices cannot be cut into equal groups that fit nodes of {per_node}")
    return out
