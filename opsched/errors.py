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
