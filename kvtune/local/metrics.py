"""Evidence from vLLM's own ``/metrics``: where each prompt token's KV came from.

vLLM 0.32 counts prompt tokens by source in ``vllm:prompt_tokens_by_source_total{source=...}``:
``local_compute`` (prefilled here), ``local_cache_hit`` (this instance's prefix cache) and
``external_kv_transfer`` (loaded through the KV connector). On a decode instance, KV that moved
shows up as ``external_kv_transfer`` and a prompt that was *not* recomputed adds (almost) nothing to
``local_compute`` — the decode recomputes at most the last prompt token to get its logits.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from kvtune.local import client
from kvtune.local.errors import LocalPairError

PROMPT_TOKENS_BY_SOURCE: Final = "vllm:prompt_tokens_by_source_total"
"""Prometheus counter of prompt tokens by source (vLLM >= 0.11)."""
SOURCE_LOCAL_COMPUTE: Final = "local_compute"
SOURCE_LOCAL_CACHE_HIT: Final = "local_cache_hit"
SOURCE_EXTERNAL_KV_TRANSFER: Final = "external_kv_transfer"

_SAMPLE_RE: Final = re.compile(r'^(?P<name>[^\s{]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL_RE: Final = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class PromptTokenSources:
    """Cumulative prompt tokens of one vLLM instance, by where their KV came from."""

    local_compute_tokens: int
    local_cache_hit_tokens: int
    external_kv_transfer_tokens: int

    def __sub__(self, other: PromptTokenSources) -> PromptTokenSources:
        return PromptTokenSources(
            self.local_compute_tokens - other.local_compute_tokens,
            self.local_cache_hit_tokens - other.local_cache_hit_tokens,
            self.external_kv_transfer_tokens - other.external_kv_transfer_tokens)

    @property
    def total_tokens(self) -> int:
        return (self.local_compute_tokens + self.local_cache_hit_tokens
                + self.external_kv_transfer_tokens)


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition: (name, labels, value); comments skipped."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        labels = dict(_LABEL_RE.findall(m.group("labels") or ""))
        samples.append((m.group("name"), labels, value))
    return samples


def prompt_token_sources_from_text(text: str) -> PromptTokenSources:
    """Sum ``vllm:prompt_tokens_by_source_total`` per source over all engines of one exposition."""
    sums = {SOURCE_LOCAL_COMPUTE: 0.0, SOURCE_LOCAL_CACHE_HIT: 0.0,
            SOURCE_EXTERNAL_KV_TRANSFER: 0.0}
    found = False
    for name, labels, value in parse_prometheus(text):
        if name == PROMPT_TOKENS_BY_SOURCE and labels.get("source") in sums:
            sums[labels["source"]] += value
            found = True
    if not found:
        raise LocalPairError(f"/metrics: expected counter {PROMPT_TOKENS_BY_SOURCE} with a "
                             f"'source' label; not found (vLLM version without it?)")
    return PromptTokenSources(int(sums[SOURCE_LOCAL_COMPUTE]), int(sums[SOURCE_LOCAL_CACHE_HIT]),
                              int(sums[SOURCE_EXTERNAL_KV_TRANSFER]))


def prompt_token_sources(url: str, *, timeout_s: float = 30.0) -> PromptTokenSources:
    """Read ``url``'s ``/metrics`` and return its prompt-token counters by source."""
    try:
        status, body = client.get(url, "/metrics", timeout_s=timeout_s)
    except client.HttpError as exc:
        raise LocalPairError(f"{url}/metrics: expected a Prometheus exposition; {exc}") from exc
    if status != 200:
        raise LocalPairError(f"{url}/metrics: expected HTTP 200, got {status}: {body[:500]}")
    return prompt_token_sources_from_text(body)


def wait_for_tokens(read, before: PromptTokenSources, tokens: int, *,
                    timeout_s: float = 30.0) -> PromptTokenSources:
    """Poll ``read()`` (bounded) until the counters moved by ``tokens`` since ``before``.

    vLLM records a step's stats after the step, so counters lag the HTTP answer; returns the last
    delta seen when ``timeout_s`` runs out (callers assert on it)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        delta = read() - before
        if delta.total_tokens >= tokens or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)
