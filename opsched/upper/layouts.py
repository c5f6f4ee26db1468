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

import re
from dataclasses import dataclass

from opsched.cost.cluster import Cluster
from opsched.cost.blocks import Mode, divisors
from opsched.errors import OpschedError
from opsched.schedule.placement import PLACEMENTS as ALL_PLACEMENTS

#: the placements a group layout may take: those with one copy of each stage (the registry's; DualPipe's two
#: copies are the lower level's, made from a chain)
PLACEMENTS = tuple(name for name, p in ALL_PLACEMENTS.items() if p.copies == 1)


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
        return ALL_PLACEMENTS[self.placement].device_of(slot, self.groups)

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

    >>> from opsched.cost.cluster import preset
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


# --------------------------------------------------------------------------- the notation, in words

#: how to read a layout's name; `opsched plan --help`, report.md and the README show this text
NOTATION = """\
How to read a layout (the devices cut into groups, the model into pipeline stages):
  GxK                   G groups of K devices; group g runs pipeline stage g (a chain of G stages)
  GxK v v=2             2 stages per group placed in a V: stages 0..G-1 go down the groups and
                        G..2G-1 come back up, so group 0 holds the first and the last stage
                        (the shape of Zero Bubble V and DualPipeV)
  GxK interleaved v=2   2 stages per group, round robin: group g holds stages g and G+g
                        (Megatron's interleaved 1F1B)
  GxK contiguous, MODE  a baseline's split: the layers cut in model order into consecutive
                        stages on G groups of K devices, every layer in the same parallel MODE
Parallel modes of a block inside its group of K devices (joined by "." when combined):
  dpN     N data-parallel replicas, each on 1/N of the microbatch; gradients all-reduced once a step
  tpN     tensor parallel: weights and compute split over N devices, activations all-reduced
  cpN     context parallel: each sequence split over N devices, keys and values passed round a ring
  epN     expert parallel: the layer's experts spread over N devices, tokens sent all-to-all
  MODE+ep the expert layers expert-parallel, every other layer in MODE (e.g. dp4+ep)
  single  one device runs the block
  per-block modes  each block in the mode the placement MIP chose for it
"""

_LAYOUT = re.compile(r"^(\d+)x(\d+)(?: (v|interleaved) v=(\d+))?(?: contiguous, (.+))?$")
#: each of :data:`opsched.cost.blocks.DEGREES` in words (tests/test_upper.py checks that every degree has its words
#: and its line in :data:`NOTATION`)
_DEGREE_WORDS = {"dp": "{n} data-parallel replicas", "tp": "tensor parallel over {n}", "ep": "expert parallel over {n}",
                 "cp": "context parallel over {n}"}
#: how a configuration's name says its expert blocks are expert-parallel over the whole group (``dp4+ep``)
EXPERTS_PARALLEL = "+ep"


def parse_config(text: str) -> tuple[Mode, bool]:
    """A configuration's name (``tp2.dp2``, ``cp2.dp4``, ``dp4+ep``, ``single``): the mode of the blocks with weights, and
    whether the expert blocks are expert-parallel over the whole group instead (``+ep``, see :data:`NOTATION`).

    >>> parse_config("tp2.dp2+ep")
    (Mode(tp=2, dp=2, ep=1, cp=1), True)
    >>> parse_config("cp2.dp4")
    (Mode(tp=1, dp=4, ep=1, cp=2), False)
    """
    base, plus, ep = text.partition("+")
    if plus and plus + ep != EXPERTS_PARALLEL:
        raise OpschedError(f"{text!r} is not a configuration: only {EXPERTS_PARALLEL} may follow the mode "
                           f"(e.g. dp4{EXPERTS_PARALLEL})")
    return Mode.parse(base), bool(plus)


def config_name(mode: Mode, experts_parallel: bool) -> str:
    """The configuration :func:`parse_config` reads back: ``mode``'s name, with ``+ep`` when the expert blocks are
    expert-parallel over the whole group instead.

    >>> config_name(Mode(tp=2, dp=2), True), config_name(Mode(dp=4), False)
    ('tp2.dp2+ep', 'dp4')
    """
    return f"{mode}{EXPERTS_PARALLEL if experts_parallel else ''}"


def mode_words(mode: str) -> str:
    """A parallel mode or configuration name (``dp4``, ``tp2.dp2``, ``dp4+ep``, ``single``) in words.

    >>> mode_words("tp2.dp2"), mode_words("dp4+ep"), mode_words("single")
    ('tensor parallel over 2 x 2 data-parallel replicas', '4 data-parallel replicas, experts expert-parallel', 'one device')
    >>> mode_words("cp2.dp4")
    'context parallel over 2 x 4 data-parallel replicas'
    >>> mode_words("per-block modes")
    'the mode the placement MIP chose for each block'
    """
    if mode == "per-block modes":
        return "the mode the placement MIP chose for each block"
    try:
        base, experts = parse_config(mode)
    except OpschedError:
        return mode  # a name this notation does not cover reads as itself
    words = " x ".join(_DEGREE_WORDS[kind].format(n=n) for kind, n in base.degrees()) or "one device"
    return words + (", experts expert-parallel" if experts else "")


def layout_devices(text: str) -> int | None:
    """The devices a layout's name spans (groups x group size), or None for a name of another form.

    >>> layout_devices("3x1 interleaved v=2"), layout_devices("4x4 contiguous, dp4+ep"), layout_devices("tp1 pp1")
    (3, 16, None)
    """
    found = _LAYOUT.match(text.strip())
    return int(found.group(1)) * int(found.group(2)) if found else None


def describe_layout(text: str) -> str:
    """A layout's name (:meth:`Layout.__str__`, or a baseline's ``GxK contiguous, MODE``) in words (see :data:`NOTATION`).

    >>> describe_layout("2x8")
    '2 groups of 8 devices, 1 pipeline stage each'
    >>> describe_layout("4x4 v v=2")
    '4 groups of 4 devices, 2 pipeline stages each in a V'
    >>> describe_layout("1x16 interleaved v=2")
    '1 group of 16 devices, 2 pipeline stages each, interleaved'
    >>> describe_layout("4x4 contiguous, dp4+ep")
    '4 groups of 4 devices, consecutive layers per stage, every layer in 4 data-parallel replicas, experts expert-parallel'
    >>> describe_layout("something else")
    'something else'
    """
    found = _LAYOUT.match(text.strip())
    if not found:
        return text
    groups, size, placement, virtual, mode = found.groups()
    words = f"{groups} group{'' if groups == '1' else 's'} of {size} device{'' if size == '1' else 's'}"
    if mode is not None:
        return f"{words}, consecutive layers per stage, every layer in {mode_words(mode)}"
    if placement is None:
        return f"{words}, 1 pipeline stage each"
    shape = " in a V" if placement == "v" else ", interleaved"
    return f"{words}, {virtual} pipeline stages each{shape}"
