"""The child side of ``kvtune probe check``: load every NIXL plugin, then a tiny real probe.

Prints one ``KVTUNE_PROBE_SELFTEST {json}`` line per finding on stdout (UCX and NIXL log around it).
"""
from __future__ import annotations

import argparse
import json
import sys

from kvtune.probe.check import SELFTEST_MARK


def _say(**kw) -> None:
    print(SELFTEST_MARK + json.dumps(kw), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtune.probe.selftest")
    parser.add_argument("--backend", default="UCX")
    args = parser.parse_args(argv)
    from kvtune.probe.agent import nixl_version
    _say(nixl_version=nixl_version())
    try:
        from nixl._api import nixl_agent, nixl_agent_config
        agent = nixl_agent("kvtune-check", nixl_agent_config(backends=[]))
    except Exception as exc:  # reported, not raised
        _say(transfer_ok=False, transfer_error=f"NIXL unusable: {type(exc).__name__}: {exc}")
        return 1
    plugins = list(agent.get_plugin_list())
    backends = []
    for name in plugins:
        try:
            agent.create_backend(name, {})
            backends.append({"name": name, "loaded": True})
        except Exception as exc:
            backends.append({"name": name, "loaded": False, "error": f"{type(exc).__name__}: {exc}"[:200]})
    _say(plugins=plugins, backends=backends)
    del agent
    from kvtune.errors import KvtuneError
    from kvtune.geometry import preset
    from kvtune.probe.sweep import ProbeConfig, run_probe
    try:
        summary = run_probe(ProbeConfig(geometry=preset("tiny"), tokens=(16,), iters=1, warmup=0,
                                        backend=args.backend, spans=False, progress=False,
                                        max_mem_mb=1, xfer_timeout_s=20.0, n_boot=10))
    except KvtuneError as exc:
        _say(transfer_ok=False, transfer_error=str(exc))
        return 1
    _say(transfer_ok=summary.verified_transfers > 0, verified=summary.verified_transfers,
         rdma_p50_ms=summary.points[0].rdma_p50_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
