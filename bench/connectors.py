"""Overhead of kvtune's instrumented connectors on vLLM's engine loop, measured in one run.

For each mode, a real CPU prefill/decode pair runs the same requests twice: once with vLLM's own
NIXL connector and once with kvtune's subclass (exporting spans to JSON-lines files, as in use).
Prints TTFT and decode step time (median and p90 per connector) and the kvtune/vLLM ratios
(aim: <= 1.02). The two pairs run one after the other on the same cores (a 2-core machine cannot
hold both at once), so the ratio also carries the machine's drift between the runs.

    flock /tmp/kvt/vllm.lock .venv/bin/python bench/connectors.py --modes pull,push --requests 20
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kvtune.local.pair import LocalPair

CONNECTORS = ("vllm", "kvtune")
FAST_EXPORT_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "500"}


@dataclass(frozen=True)
class Sample:
    ttft_ms: float
    step_ms: float


def _prompt(i: int, length: int) -> list[int]:
    """Distinct prompts (no prefix-cache hits between requests), identical across connectors."""
    return [(7 + i * 131 + k * 17) % 1900 + 50 for k in range(length)]


def run_pair(mode: str, connector: str, workdir: Path, n: int, prompt_len: int,
             max_tokens: int) -> list[Sample]:
    spans_dir = workdir / "spans" if connector == "kvtune" else None
    samples: list[Sample] = []
    with LocalPair(mode, connector=connector, workdir=workdir / "work", spans_dir=spans_dir,
                   extra_env=FAST_EXPORT_ENV) as pair:
        for i in tqdm(range(n), desc=f"{mode}/{connector}", file=sys.stderr):
            r = pair.complete(_prompt(i, prompt_len), max_tokens, request_id=f"bench-{mode}-{i}")
            if r.ttft_ms is None:
                continue
            # First decode token seen at ttft - prefill leg (pull) or ttft (push: both legs at once).
            first_in_decode = r.ttft_ms - (r.prefill_ms or 0.0) if mode != "push" else r.ttft_ms
            samples.append(Sample(r.ttft_ms, (r.decode_ms - first_in_decode) / (max_tokens - 1)))
    return samples


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="pull", help="comma-separated: pull, push")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="kvtune-bench-connectors-"))
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        results = {c: run_pair(mode, c, root / mode / c, args.requests, args.prompt_tokens,
                               args.max_tokens) for c in CONNECTORS}
        print(f"\nmode={mode} requests={args.requests} prompt_tokens={args.prompt_tokens} "
              f"max_tokens={args.max_tokens}")
        print(f"{'connector':<8} {'ttft p50 ms':>12} {'ttft p90 ms':>12} {'step p50 ms':>12} "
              f"{'step p90 ms':>12}")
        med: dict[str, tuple[float, float]] = {}
        for c, s in results.items():
            ttft = [x.ttft_ms for x in s]
            step = [x.step_ms for x in s]
            med[c] = (statistics.median(ttft), statistics.median(step))
            print(f"{c:<8} {med[c][0]:>12.2f} {_p(ttft, 90):>12.2f} {med[c][1]:>12.2f} "
                  f"{_p(step, 90):>12.2f}")
        print(f"ratio kvtune/vllm: ttft p50 {med['kvtune'][0] / med['vllm'][0]:.3f}, "
              f"decode step p50 {med['kvtune'][1] / med['vllm'][1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
