"""``kvtune probe run|serve|check``: parse, call one library function, print its result."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvtune import telemetry
from kvtune.errors import ConfigError
from kvtune.geometry import PRESETS, from_hf_config, preset
from kvtune.probe.agent import DEFAULT_BACKEND
from kvtune.probe.initiator import DEFAULT_XFER_TIMEOUT_S
from kvtune.probe.sweep import DEFAULT_MAX_MEM_MB
from kvtune.probe.target import DEFAULT_PORT, DEFAULT_TARGET_MAX_MEM_MB, SESSION_MAX_S


def register(subparsers) -> None:
    p = subparsers.add_parser("probe", help="measure a fabric's per-transfer floor with real NIXL transfers",
                              description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="probe_command", metavar="{run,serve,check}")
    sub.required = True

    r = sub.add_parser("run", help="sweep KV-shaped READ/WRITE transfers and fit floor + bandwidth")
    r.add_argument("--peer", metavar="HOST:PORT", help="a `kvtune probe serve` target "
                   "(default: start one in a child process on this host)")
    model = r.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, choices=sorted(PRESETS),
                       help="model preset (default qwen3-32b)")
    model.add_argument("--config", type=Path, metavar="CONFIG_JSON", help="a local Hugging Face config.json")
    r.add_argument("--tp", type=int, default=1, help="tensor-parallel size (bytes are per rank)")
    r.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (vLLM's)")
    r.add_argument("--tokens", type=_int_list, help="token counts per rank, comma separated "
                   "(default 16..32768 doubling, within --max-mem-mb)")
    r.add_argument("--ops", type=_str_list, default=["READ", "WRITE"], help="read,write")
    r.add_argument("--layout", type=_str_list, default=["per_block"],
                   help="per_block (vLLM), merged, or both comma separated")
    r.add_argument("--iters", type=int, default=20, help="measured iterations per point")
    r.add_argument("--warmup", type=int, default=3, help="warm-up iterations per point (not fitted)")
    r.add_argument("--backend", default=DEFAULT_BACKEND, help="NIXL backend (default UCX)")
    r.add_argument("--fabric", default="", help="a name for this fabric, recorded on every span")
    r.add_argument("--max-mem-mb", type=int, default=DEFAULT_MAX_MEM_MB,
                   help="cap on each side's probe buffer in MiB (limits the largest point)")
    r.add_argument("--spans", type=Path, metavar="DIR",
                   help="write both sides' spans (OTLP-JSON lines) here (OTEL_EXPORTER_OTLP_ENDPOINT "
                        "and KVTUNE_SPANS_DIR are honoured too)")
    r.add_argument("--json", type=Path, metavar="OUT", help="write the summary as JSON here")
    r.add_argument("--xfer-timeout-s", type=float, default=DEFAULT_XFER_TIMEOUT_S,
                   help="a transfer not complete after this long fails the run")
    r.add_argument("--no-verify", action="store_true", help="skip checking the target's bytes")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=run)

    s = sub.add_parser("serve", help="be the target of `kvtune probe run --peer` on another host")
    s.add_argument("--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="side-channel port (0: any free)")
    s.add_argument("--backend", default=DEFAULT_BACKEND)
    s.add_argument("--fabric", default="")
    s.add_argument("--max-mem-mb", type=int, default=DEFAULT_TARGET_MAX_MEM_MB,
                   help="largest buffer one initiator may ask for, MiB")
    s.add_argument("--spans", type=Path, metavar="DIR", help="write this side's spans here")
    s.add_argument("--spans-file", type=Path, help=argparse.SUPPRESS)
    s.add_argument("--max-sessions", type=int, default=None, help="exit after N initiators")
    s.add_argument("--session-max-s", type=float, default=SESSION_MAX_S,
                   help="end any session after this many seconds (one initiator at a time: no "
                        "peer may hold the target for ever)")
    s.set_defaults(func=serve)

    c = sub.add_parser("check", help="NIXL/UCX readiness: plugins, backends, transports actually used")
    c.add_argument("--backend", default=DEFAULT_BACKEND)
    c.add_argument("--require-rdma", action="store_true", help="fail unless UCX moved data over RDMA")
    c.add_argument("--json", type=Path, metavar="OUT", help="write the report as JSON here")
    c.set_defaults(func=check)


def _int_list(value: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {value!r}")
    return out


def _str_list(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def _quiet_nixl(args: argparse.Namespace) -> None:
    """NIXL's Python logger prints INFO lines to stdout; keep them out of the probe's output
    (here and in its child processes) unless ``kvtune -v`` or ``NIXL_LOG_LEVEL`` asks for them."""
    if not getattr(args, "verbose", False):
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL spells it WARN


def run(args: argparse.Namespace) -> int:
    from kvtune.probe.sweep import ProbeConfig, run_and_write
    _quiet_nixl(args)
    if args.config is not None:
        geometry = from_hf_config(args.config, args.tp, block_size_tokens=args.block_size)
    else:
        geometry = preset(args.model or "qwen3-32b", args.tp, block_size_tokens=args.block_size)
    if args.tp < 1:
        raise ConfigError(f"--tp: expected an integer >= 1, got {args.tp}")
    config = ProbeConfig(geometry=geometry, tokens=tuple(args.tokens) if args.tokens else None,
                         ops=tuple(args.ops), layouts=tuple(args.layout), iters=args.iters,
                         warmup=args.warmup, peer=args.peer, backend=args.backend, fabric=args.fabric,
                         max_mem_mb=args.max_mem_mb,
                         spans=args.spans is not None or telemetry.configured_by_env(),
                         spans_dir=args.spans, verify=not args.no_verify,
                         xfer_timeout_s=args.xfer_timeout_s, seed=args.seed,
                         progress=not args.no_progress)
    summary = run_and_write(config, json_path=args.json)
    print(summary.table())
    return 0


def serve(args: argparse.Namespace) -> int:
    from kvtune.probe.target import serve as serve_target
    _quiet_nixl(args)
    serve_target(args.bind, args.port, backend=args.backend, max_mem_mb=args.max_mem_mb,
                 fabric=args.fabric, spans_file=args.spans_file or args.spans,
                 max_sessions=args.max_sessions, session_max_s=args.session_max_s)
    return 0


def check(args: argparse.Namespace) -> int:
    from kvtune.probe.check import check as run_check
    report = run_check(backend=args.backend)
    print(report.text())
    if args.json:
        args.json.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    if not report.ok(require_rdma=args.require_rdma):
        why = "no RDMA transport was used" if report.transfer_ok else "the test transfer failed"
        print(f"kvtune probe check: FAILED: {why}", file=sys.stderr)
        return 1
    return 0
