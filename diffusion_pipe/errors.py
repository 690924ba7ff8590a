"""The base of every error that is the user's to fix (a param, a file, the store), as opposed to a bug.

Commands print such an error as one line naming what to fix and exit with status 2, without a traceback.
"""


class UserError(ValueError):
    """Bad input or state that the message explains how to fix."""
