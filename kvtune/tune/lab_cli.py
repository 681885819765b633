"""`kvtune lab`: parse, coerce, call `kvtune.tune.lab.prepare`, then run JupyterLab."""
from __future__ import annotations

import argparse
import subprocess

from kvtune.tune.cli import load_parameters
from kvtune.tune.lab import DEFAULT_LAB_DIR, DEFAULT_TRACES, lab_command, lab_env, prepare
from kvtune.tune.notebooks import TUNE_NOTEBOOKS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lab", help="open kvtune's notebooks in JupyterLab, parameters filled",
                       description="Write kvtune's notebooks with their parameters filled (a "
                                   "papermill injected-parameters cell) into --out and open them in "
                                   "JupyterLab on 127.0.0.1.")
    p.add_argument("--traces", default=None,
                   help=f"OTLP-JSON file/dir/glob or tempo+http://HOST:PORT (default: {DEFAULT_TRACES}, "
                        f"the spans of the last `kvtune tune`)")
    p.add_argument("--out", default=str(DEFAULT_LAB_DIR),
                   help=f"workspace for the notebooks (default {DEFAULT_LAB_DIR})")
    p.add_argument("--model", default=None, help="model name or path for `vllm serve` (model_name)")
    p.add_argument("-p", "--parameters", nargs=2, action="append", default=[],
                   metavar=("NAME", "VALUE"), help="notebook parameter (papermill style)")
    p.add_argument("-f", "--parameters-file", default=None, help="YAML file of parameters")
    p.add_argument("--notebooks", default=",".join(TUNE_NOTEBOOKS),
                   help="comma-separated notebooks to open (default: all)")
    p.add_argument("--port", type=int, default=8888, help="JupyterLab's port on 127.0.0.1")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    params = load_parameters(args)
    if args.model:
        params["model_name"] = args.model
    ws = prepare(args.traces, args.out, parameters=params,
                 notebooks=[n for n in args.notebooks.split(",") if n])
    print(f"kvtune lab: {len(ws.notebooks)} notebooks in {ws.root} (traces: {ws.parameters['traces']})")
    cmd = lab_command(ws, port=args.port, open_browser=not args.no_browser)
    try:
        return subprocess.call(cmd, env=lab_env())
    except KeyboardInterrupt:
        return 130
