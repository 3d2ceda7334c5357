"""The one exception type for user mistakes.

Everything a user can get wrong (a missing file, a bad flag, an infeasible
problem, a corrupted JSON) raises :class:`DeeppoolError` with a one-line
message that names what is wrong and how to fix it. The CLI turns it into that
line on stderr and exit code 2; any other exception is a bug.
"""


class DeeppoolError(Exception):
    """A user-facing error: the message is one line and says how to fix it."""

    exit_code = 2
