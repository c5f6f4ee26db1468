"""The one exception type a user sees.

Anything that is the user's input being wrong (a missing file, an unresolved
dimension, a memory limit no schedule meets, an unmet precondition) raises
:class:`OpschedError` with a one-line message that says what is wrong and how
to fix it. The CLI prints that line to stderr and exits with code 2; every
other exception is a bug and keeps its traceback.
"""


class OpschedError(Exception):
    """A user-facing error: one line, what is wrong and how to fix it."""

    exit_code = 2


class Unsupported(OpschedError):
    """A method's preconditions do not hold for this input (e.g. DualPipe with odd PP)."""


class OverMemory(Unsupported):
    """A method's schedule needs more memory per device than the limit.

    ``peak`` and ``limit`` are in the caller's units (bytes in a plan, the
    units of A in a synthetic ``compare``), so the message is worded by the
    one who knows them (:meth:`worded`); ``str()`` writes plain numbers.

    >>> OverMemory("gpipe", 3.0, 2.0).worded(lambda x: f"{x:g} GiB")
    'gpipe needs 3 GiB per device, over the memory limit 2 GiB'
    """

    def __init__(self, method: str, peak: float, limit: float):
        super().__init__(method, peak, limit)  # every field in args, so it survives pickling from a child process
        self.method, self.peak, self.limit = method, peak, limit

    def worded(self, amount) -> str:
        """The message with each memory figure written by ``amount`` (a float -> str function)."""
        return f"{self.method} needs {amount(self.peak)} per device, over the memory limit {amount(self.limit)}"

    def __str__(self) -> str:
        return self.worded(lambda x: f"{x:g}")


class Deadlock(OpschedError):
    """An order cannot run to the end: every device waits for another (a user's order is wrong;
    inside the planner, a candidate order is skipped)."""


class NoScheduleInTime(OpschedError):
    """A solve told not to make a fallback found no schedule within its time (a search over placements, which has
    one in hand already, asks so: the fallback's own work would run past its share)."""


class MemoryTooSmall(OpschedError):
    """The memory limit is below what any schedule needs; ``minimum`` is the least limit that works."""

    def __init__(self, message: str, minimum: float):
        super().__init__(message, minimum)  # both in args, so it survives pickling from a child process
        self.minimum = minimum

    def __str__(self) -> str:
        return self.args[0]


class NoRunnablePlan(OpschedError):
    """No plan the search found can run on the runtime asked for (``opsched plan --runtime``); ``reasons`` says why
    for each kind of candidate, so the command can add how to widen the search."""

    def __init__(self, message: str, reasons: list[str]):
        super().__init__(message, reasons)  # both in args, so it survives pickling from a child process
        self.reasons = reasons

    def __str__(self) -> str:
        return self.args[0]
