"""The scan's user-facing error, in a module of its own so importing it costs nothing."""

from diffusion_pipe.errors import UserError


class ScanError(UserError):
    """The datasets break a scan policy (e.g. missing captions with caption_policy 'error'); says how to fix it,
    one problem a line, every file name in it through `printable`."""

    printable_lines = True
