"""The scan's user-facing error, in a module of its own so importing it costs nothing."""


class ScanError(ValueError):
    """The datasets break a scan policy (e.g. missing captions with caption_policy 'error'); says how to fix it."""
