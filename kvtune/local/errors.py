"""Errors of the local vLLM test bed."""
from __future__ import annotations

from kvtune.errors import KvtuneError


class LocalPairError(KvtuneError):
    """A local vLLM server failed: start-up timeout, early exit, an HTTP error or a broken P/D flow.

    The message names the server and what was expected, and ends with the last lines of every
    server's log so that the cause is visible where the error is reported (CI logs, pytest).
    """
