"""Small helpers the baseline modules share."""

from __future__ import annotations

from opsched.errors import Unsupported
from opsched.schedule import INPUT_GRADIENT_PASSES, Job, PassKind


def check_microbatches(method: str, microbatches: int, minimum: int, *, even: bool = False, why: str = "") -> None:
    """Raise Unsupported unless ``microbatches >= minimum`` (and even if asked)."""
    if microbatches < minimum or (even and microbatches % 2):
        need = f"microbatches >= {minimum}" + (" and even" if even else "")
        reason = f" ({why})" if why else ""
        raise Unsupported(f"{method} needs {need}{reason}; got {microbatches}")


class Counters:
    """Next microbatch per (stage, kind): the way hand-written schedules pick microbatches.

    Every stage processes its microbatches in increasing order per pass kind.
    ``ids`` maps a stage to the microbatch ids it runs (default 0, 1, 2, ...).
    """

    def __init__(self, ids: dict[int, tuple[int, ...]] | None = None):
        self.ids = ids or {}
        self.next: dict[tuple[int, PassKind], int] = {}

    def take(self, stage: int, kind: PassKind) -> int:
        """The next microbatch id of ``stage`` for ``kind`` (F, I/B share one counter, W)."""
        key = (stage, PassKind.I if kind in INPUT_GRADIENT_PASSES else kind)
        k = self.next.get(key, 0)
        self.next[key] = k + 1
        ids = self.ids.get(stage)
        return k if ids is None else ids[k]

    def job(self, stage: int, kind: PassKind) -> Job:
        return Job(stage, self.take(stage, kind), kind)
