"""`kvtune tune`: parse, coerce, call `run_tune`."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtune.errors import ConfigError
from kvtune.tune.notebooks import TUNE_NOTEBOOKS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="run the tuning notebooks and export recommended configs",
                       description="Run kvtune's tuning notebooks (papermill) on a trace source — or, "
                                   "without --traces, on spans kvtune makes on this machine — and "
                                   "write executed notebooks, report.html, recommendation.json and "
                                   "the config files.")
    p.add_argument("--traces", default=None, help="OTLP-JSON file/dir/glob or tempo+http://HOST:PORT")
    p.add_argument("--out", default="out/tune", help="output directory (default out/tune)")
    p.add_argument("--model", default=None,
                   help="model name or path for `vllm serve` in the exported files (the notebook "
                        "parameter model_name; default: kv.model from the spans)")
    p.add_argument("-p", "--parameters", nargs=2, action="append", default=[],
                   metavar=("NAME", "VALUE"), help="notebook parameter (papermill style)")
    p.add_argument("-f", "--parameters-file", default=None, help="YAML file of parameters")
    p.add_argument("--fabric", default="loopback", metavar="loopback|auto|shaped:RATE",
                   help="without --traces: the fabric kvtune's own pair and probe run on: loopback "
                        "(default), a veth link to a network namespace shaped to RATE (e.g. "
                        "shaped:200mbit; needs root, ip and tc), or auto (shaped:1gbit where "
                        "possible, else loopback; what `make tune` uses)")
    p.add_argument("--lab", default=None, metavar="fleet|warm",
                   help="without --traces: the lab regime kvtune's own pair runs in (default "
                        "fleet: later turns reach a prefill that lacks the history, as in a fleet; "
                        "warm: one prefill whose prefix cache keeps every history; see "
                        "kvtune.local.regime)")
    p.add_argument("--verify", action="store_true",
                   help="without --traces: then replay the same kind of traffic on the local pair "
                        "under vLLM's defaults and under the recommendation (kvtune verify) and "
                        "state the verdict at the top of the report (a few minutes more)")
    p.add_argument("--max-spans", type=int, default=None, metavar="N",
                   help="with --traces: reduce the source in bounded memory to a sample of whole "
                        "conversations holding about N spans, the fits reading more (kvtune.analysis."
                        "reduced; a source over 512 MiB of span files is reduced to 200,000 spans "
                        "without it)")
    p.add_argument("--notebooks", default=",".join(TUNE_NOTEBOOKS),
                   help="comma-separated notebooks to run (default: all)")
    p.set_defaults(func=run)


def load_parameters(args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    params: dict[str, Any] = {}
    if args.parameters_file:
        path = Path(args.parameters_file)
        if not path.exists():
            raise ConfigError(f"parameters file {path}: no such file")
        from kvtune import safe_yaml
        loaded = safe_yaml.load(path.read_text(), source=f"parameters file {path}") or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"parameters file {path}: expected a mapping of name: value")
        params.update(loaded)
    for name, value in args.parameters:
        params[name] = yaml.safe_load(value) if value else value
    return params


def run(args: argparse.Namespace) -> int:
    from kvtune.local.fabric import parse_fabric
    from kvtune.tune.run import run_tune

    params = load_parameters(args)
    if args.model:
        params["model_name"] = args.model
    fabric = parse_fabric(args.fabric)
    if args.traces and fabric.rate_mbit is not None:
        raise ConfigError(f"--fabric {args.fabric}: applies only without --traces (it shapes the "
                          f"link of the spans kvtune makes itself)")
    if args.lab is not None and args.traces:
        raise ConfigError(f"--lab {args.lab}: applies only without --traces (it is the regime of "
                          f"the pair kvtune runs itself)")
    if args.verify and args.traces:
        raise ConfigError("--verify: applies only without --traces (it replays the traffic of the "
                          "pair kvtune runs itself; for your cluster run `kvtune verify "
                          "--tune-dir OUT --prefill URL --decode URL`)")
    if args.max_spans is not None:
        if args.max_spans < 1 or not args.traces:
            raise ConfigError(f"--max-spans {args.max_spans}: expected a whole number of spans "
                              f">= 1, with --traces")
        import os
        from kvtune.analysis.reduced import MAX_SPANS_ENV
        os.environ[MAX_SPANS_ENV] = str(args.max_spans)  # the notebooks' kernels inherit it
    default_source: dict[str, Any] = {}
    if fabric.rate_mbit is not None:
        default_source["fabric"] = fabric
    if args.lab is not None:
        from kvtune.local.regime import regime
        default_source["regime"] = regime(args.lab)
    result = run_tune(args.traces, args.out, parameters=params,
                      notebooks=[n for n in args.notebooks.split(",") if n],
                      default_source=default_source or None)
    print(f"kvtune tune: done in {result.elapsed_s:.0f} s; trace source: {result.source} "
          f"({result.source_kind})")
    print(f"  report:          {result.report_html}")
    print(f"  recommendation:  {result.recommendation_json}")
    print(f"  configs:         {result.out_dir / 'configs'}")
    print(f"  notebooks:       {result.out_dir / 'notebooks'}")
    if result.recommendation_json.exists():
        from kvtune.tune.headline import MODE, THRESHOLD, TTL
        rec = json.loads(result.recommendation_json.read_text())
        print(f"  model:           {rec.get('model')} ({rec.get('model_source')})")
        for key in (THRESHOLD, TTL, MODE):
            item = rec.get("recommendations", rec).get(key, rec.get(key))
            value = item.get("value") if isinstance(item, dict) else item
            print(f"  {key:24s} {value}")
    if args.verify:
        _verify(result, fabric.rate_mbit)
    return 0


def _verify(result: Any, rate_mbit: float | None) -> None:
    from kvtune.verify.tune_link import verify_tune_dir

    if result.source_kind != "vllm-pair":
        print(f"  verification:    skipped: the spans came from {result.source_kind}, not the "
              f"local vLLM pair it would replay on")
        return
    from kvtune.verify.page import crossover_text

    res = verify_tune_dir(result.out_dir, shaped_rate_mbit=rate_mbit)
    for comp in res.comparisons:
        print(f"  verification:    {comp.verdict}")
    if res.predictions is not None:
        for line in res.predictions.lines():
            print(f"    {line}")
    if res.crossover is not None:
        print(f"    {crossover_text(res)}")
    print(f"  report (again):  {result.report_html}")
