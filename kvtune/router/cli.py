"""``kvtune router``: run the KV-aware router (see :mod:`kvtune.router.server` for the flows).

Either ``--config FILE`` (YAML/JSON, keys in :mod:`kvtune.router.config`) or ``--prefill URL
--decode URL --mode M`` (both repeatable). Flags given with ``--config`` override the file. For push
mode without a file, name each prefill's engine id and side-channel port in the URL's fragment:
``--prefill 'http://127.0.0.1:8100#engine_id=prefill-0&kv_port=5600'``.
"""
from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kvtune.errors import ConfigError
from kvtune.router.config import RouterConfig, config_from_dict, load_config
from kvtune.vllm_pd import MODES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="router config file (YAML or JSON)")
    p.add_argument("--prefill", metavar="URL", action="append",
                   help="prefill instance URL (repeatable); push: URL#engine_id=ID&kv_port=N")
    p.add_argument("--decode", metavar="URL", action="append", help="decode instance URL (repeatable)")
    p.add_argument("--mode", choices=MODES, help="routing mode (default pull)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (0: any free port; default 8000)")
    p.add_argument("--state", metavar="SPEC",
                   help="conversation store: sqlite:PATH (default sqlite:router-state.db) or redis://HOST:PORT/DB")
    p.add_argument("--decoder-ttl-s", type=float, help="the decode's decoder_kv_blocks_ttl, seconds")
    p.add_argument("--margin-s", type=float, help="stored params expire this long before the decode's TTL")
    p.add_argument("--port-file", metavar="FILE", help="write the bound port here once serving")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("router", help="run the KV-aware multi-turn router",
                              description=__doc__.splitlines()[0])
    add_arguments(p)
    p.set_defaults(func=run)


def _instance(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    out: dict[str, Any] = {"url": url.split("#", 1)[0]}
    for key, value in parse_qsl(parts.fragment):
        out[key] = value
    return out


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The config the flags describe (a file, then flags on top)."""
    data: dict[str, Any] = {}
    if args.config:
        data = load_config(args.config).to_dict()
    elif not (args.prefill and args.decode):
        raise ConfigError("kvtune router: expected --config FILE, or --prefill URL and --decode URL")
    if args.prefill:
        data["prefill"] = [_instance(u) for u in args.prefill]
    if args.decode:
        data["decode"] = [_instance(u) for u in args.decode]
    for flag, key in (("mode", "mode"), ("host", "host"), ("port", "port"), ("state", "state"),
                      ("decoder_ttl_s", "decoder_ttl_s"), ("margin_s", "margin_s")):
        value = getattr(args, flag)
        if value is not None:
            data[key] = value
    return config_from_dict(data, source=args.config or "kvtune router flags")


def run(args: argparse.Namespace) -> int:
    from kvtune.router.server import run_router
    return run_router(config_from_args(args), port_file=args.port_file)
