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


class Deadlock(OpschedError):
    """An order cannot run to the end: every device waits for another (a user's order is wrong;
    inside the planner, a candidate order is skipped)."""


class MemoryTooSmall(OpschedError):
    """The memory limit is below what any schedule needs; ``minimum`` is the least limit that works."""

    def __init__(self, message: str, minimum: float):
        super().__init__(message, minimum)  # both in args, so it survives pickling from a child process
        self.minimum = minimum

    def __str__(self) -> str:
        return self.args[0]
