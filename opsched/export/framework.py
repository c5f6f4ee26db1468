"""The training frameworks a plan is exported for, as their refusals name them."""

from __future__ import annotations

from typing import NamedTuple

from opsched.errors import OpschedError


class Framework(NamedTuple):
    """A training framework as its refusals name it: the one home of "X cannot run this plan: ..."."""

    #: its name in refusals, e.g. "Megatron-LM"
    name: str
    #: what to plan instead of DualPipe's two copies of every stage there
    instead_of_dual: str

    def cannot_run(self, reason: str) -> OpschedError:
        """The refusal of a plan this framework cannot run, for ``reason``.

        >>> str(Framework("torchtitan", "").cannot_run("a V"))
        'torchtitan cannot run this plan: a V'
        """
        return OpschedError(f"{self.name} cannot run this plan: {reason}")
