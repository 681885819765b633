"""The one redaction rule for URLs and DSNs: a password never leaves in what kvtune shows.

Everywhere a URL is shown, logged, put in a header, an error body, ``/health`` or a span (the
router's upstream instances, its Redis state store, the Tempo reader's source), it goes through
:func:`redact_url`; free text that may quote one (an exception's message) through
:func:`redact_text`. The rule: the password of a URL's user info is replaced by
:data:`MASK` (``http://user:***@host/``, ``redis://:***@host:6379/0``), and so is the value of a
query parameter that names a secret (``password``, ``token``, ...). The user name and the rest of
the URL stay: they say which server, and are not secrets.
"""
from __future__ import annotations

import functools
import re
import urllib.parse
from typing import Final

MASK: Final = "***"
"""What a redacted secret reads as."""
SECRET_QUERY_KEYS: Final = frozenset({"password", "passwd", "pass", "pwd", "secret", "token",
                                      "access_token", "api_key", "apikey", "key", "auth"})
"""Query parameters whose values are hidden (lower-cased names)."""
REDACTED_URLS_CACHED: Final = 1024
"""URLs whose redaction is remembered (a router's instances and store; a bound on memory)."""

# scheme://[user]:password@  (the password is anything up to the last '@' before the host part)
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/?#@:]*:)(?P<pw>[^\s/?#]*)@")
_QUERY = re.compile(r"(?P<head>[?&;](?P<key>[A-Za-z_\-]+)=)(?P<value>[^&#\s'\"]*)")


@functools.lru_cache(maxsize=REDACTED_URLS_CACHED)
def redact_url(url: str) -> str:
    """``url`` with its password (and any secret query value) replaced by :data:`MASK`. Cached:
    the router shows the same few instance URLs on every request's span."""
    if not isinstance(url, str):
        return url
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return redact_text(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{host}"
    query = _redact_query(parts.query) if parts.query else parts.query
    if netloc == parts.netloc and query == parts.query:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def redact_text(text: str) -> str:
    """``text`` with the password of every URL in it (and secret query values) replaced."""
    if not isinstance(text, str) or ("@" not in text and "=" not in text):
        return text
    out = _USERINFO.sub(lambda m: f"{m['head']}{MASK}@", text)
    return _QUERY.sub(_query_sub, out)


def _query_sub(m: re.Match[str]) -> str:
    if m["key"].lower() in SECRET_QUERY_KEYS and m["value"]:
        return f"{m['head']}{MASK}"
    return m.group(0)


def _redact_query(query: str) -> str:
    return _QUERY.sub(_query_sub, "?" + query)[1:]
