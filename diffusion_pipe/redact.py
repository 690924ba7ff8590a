"""Credentials never leave in what we print or record: the password of a URL's userinfo and secret-looking query
parameters are masked wherever a URL is shown (errors, reports, lineage). Pure functions, no imports to speak of.

`ssh://user:password@host/path` -> `ssh://user:***@host/path`; `https://host/x?token=abc` -> `...?token=***`. The
user name stays (it says which account, and is no secret); a URL without credentials is returned unchanged.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
# scheme://user:password@host : the password is whatever stands between "user:" and the last '@' of the URL, so
# one holding '/', ':', '?' or '@' (S3 secret keys often hold '/') is masked whole. A '@' later in the path makes
# this mask more than the password (a host and part of the path), never less.
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/@:]*:)(?P<secret>\S*)(?=@)")
# ?name=value or &name=value where the name says it is a secret.
_QUERY = re.compile(
    r"(?P<head>[?&](?:[A-Za-z0-9_\-]*(?:password|passwd|secret|token|key|signature|credential|sig|auth)"
    r"[A-Za-z0-9_\-]*)=)(?P<secret>[^&#\s'\"]+)",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it masked (see the module docstring)."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(lambda m: m["head"] + MASK, text)
    return _QUERY.sub(lambda m: m["head"] + MASK, text)


def redact_obj(obj: Any) -> Any:
    """A copy of a JSON-like value (dicts, lists, strings) with every string passed through `redact`."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_obj(v) for v in obj)
    return obj
