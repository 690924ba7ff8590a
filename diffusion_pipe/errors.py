"""The base of every error that is the user's to fix (a param, a file, the store), as opposed to a bug.

Commands print such an error as one line naming what to fix and exit with status 2, without a traceback, through
`error_text`: a file name in the message may hold a newline or an ESC sequence, which printed raw would forge lines
or drive the terminal.
"""

from __future__ import annotations

_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """`text` safe to print on one terminal line: a backslash doubled, and every character that is not printable
    (control characters, line and paragraph separators, format characters such as U+202E that reorder the
    line) written as a Python escape (`\\n`, `\\x1b`, `\\u202e`). Printable text, non-ASCII included, is unchanged."""
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def error_message(error: BaseException | str) -> str:
    """`error`'s message safe to print: through `printable`, so no file name it quotes can break the line or write
    to the terminal; a message of several lines that escaped its names itself (`printable_lines`: the scan's
    problems, a line each) as it is."""
    text = str(error)
    return text if getattr(error, "printable_lines", False) else printable(text)


def error_text(error: BaseException | str) -> str:
    """`error` as a command prints it: 'error: ' and `error_message`."""
    return f"error: {error_message(error)}"


class UserError(ValueError):
    """Bad input or state that the message explains how to fix."""

    printable_lines = False  # True: the message's lines are meant, and every name in them went through printable
