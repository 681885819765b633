"""Write kvtune's notebooks (kvtune/notebooks/*.ipynb, package data) from the cell texts below.

Run: .venv/bin/python scripts/make_notebooks.py   (a test checks the committed notebooks match)
Each notebook: one cell tagged `parameters`, then calls into the library and figures.
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]

PARAMETERS = '''\
# Parameters (papermill: -p NAME VALUE or -f params.yaml)
# traces: OTLP-JSON file, directory or glob, or tempo+http://HOST:PORT
traces = ""
# fabric: the fabric's name, for the record
fabric = "local"
# model: geometry preset (qwen3-32b) or a config.json path; empty: infer from the spans
model = ""
# model_name: the model name or path `vllm serve` takes; empty: kv.model from the spans
model_name = ""
# tp_size: tensor-parallel size
tp_size = 1
# hbm_budget_gb: decode memory allowed for retained KV, GB
hbm_budget_gb = 1.0
# nominal_gbps: the link nominal rate, 0 when unknown
nominal_gbps = 0.0
# early_decode_ok: may the router choose the decode instance up front (push)
early_decode_ok = True
# out_dir: where configs and recommendation.json go
out_dir = "out/tune"
seed = 0
# tuning_json: the tuning `kvtune tune` computed once, to draw; empty: computed here
tuning_json = ""
'''

LOAD = '''\
from kvtune import analysis, nb, plots
from kvtune.tune import figures, findings

spans = nb.load_spans(traces)
geometry = nb.geometry(model, tp_size)
tx = analysis.transfers(spans)
print(f"{len(spans)} spans, {len(tx)} transfers from {traces}")
'''

RECOMMEND = '''\
tuning = nb.tuning(spans, tuning_json, traces=traces, model=model, tp_size=tp_size,
                   hbm_budget_gb=hbm_budget_gb, early_decode_ok=early_decode_ok, seed=seed)
'''

NOTEBOOKS: dict[str, list[tuple[str, str]]] = {
    "fabric_floor": [
        ("markdown", "# Fabric floor\nWhat one KV transfer costs before bandwidth: transfer time "
                     "against bytes, the fitted floor and bandwidth with 95% intervals, where the "
                     "time goes per phase, and the readiness findings."),
        ("code", LOAD),
        ("code", 'fits = figures.fits_by_fabric(tx, seed=seed)\n'
                 'groups = figures.fit_groups(tx)\n'
                 'for key, fit in fits.items():\n'
                 '    if isinstance(fit, str):\n'
                 '        print(f"{key}: no fit: {fit}")\n'
                 '        continue\n'
                 '    print(f"{key}: floor {fit.floor_ms:.3f} ms {fit.floor_ci_ms}, "\n'
                 '          f"{fit.bandwidth_gbps:.2f} Gb/s {fit.bandwidth_ci_gbps}, r2 {fit.r2:.3f}")\n'
                 '    nb.show(plots.floor_fit(groups[key], fit, title=f"Transfer time vs bytes: {key}"),\n'
                 '            f"fit-{key}")\n'
                 'nb.publish("fits", {k: (v.as_dict() if not isinstance(v, str) else v)\n'
                 '                    for k, v in fits.items()})'),
        ("code", 'nb.show(plots.phase_split(tx), "phases")'),
        ("code", 'nb.show(plots.efficiency(tx, nominal_gbps=nominal_gbps), "efficiency")'),
        ("code", RECOMMEND + 'nb.publish("floor_ms", tuning.fit.floor_ms)\n'
                 'nb.publish("bandwidth_gbps", tuning.fit.bandwidth_gbps)\n'
                 'nb.publish("fit_source", tuning.extra.get("fit_source"))\n'
                 'findings.FindingsView.of(tuning)'),
    ],
    "recompute_threshold": [
        ("markdown", "# kv_recompute_threshold\nPulling R tokens of history back costs the floor "
                     "plus R x bytes/token / bandwidth; recomputing them costs the measured prefill "
                     "time. The threshold is the break-even R, with its uncertainty; vLLM's default "
                     "(64) is marked."),
        ("code", LOAD),
        ("code", RECOMMEND + 'prefill = analysis.prefill_cost(spans)\n'
                 'nb.publish("kv_recompute_threshold", tuning.threshold.value)\n'
                 'nb.publish("kv_recompute_threshold_range", list(tuning.threshold.range))\n'
                 'tuning.threshold.as_dict()["evidence"]'),
        ("code", 'nb.show(plots.threshold_curve(tuning, prefill), "threshold")'),
    ],
    "block_ttl": [
        ("markdown", "# decoder_kv_blocks_ttl\nRetained blocks cost decode memory for the whole TTL; "
                     "a next turn is reused only if it comes back within it. The TTL that captures "
                     "the most reuse the memory budget allows, and the router's cache TTL below it."),
        ("code", LOAD),
        ("code", RECOMMEND + 'wl = analysis.workload(spans)\n'
                 'nb.publish("decoder_kv_blocks_ttl", tuning.ttl.value)\n'
                 'nb.publish("router_ttl_s", tuning.ttl.as_dict()["evidence"]["router_params_ttl_s"])\n'
                 'tuning.ttl.as_dict()["evidence"]'),
        ("code", 'nb.show(plots.gap_histogram(wl.gaps_s, ttl_s=tuning.ttl.value,\n'
                 '                            router_ttl_s=tuning.ttl.as_dict()["evidence"]["router_params_ttl_s"]),\n'
                 '        "gaps")'),
        ("code", 'curve = figures.ttl_curve(tuning, wl)\n'
                 'nb.show(plots.ttl_curves(curve["ttls_s"], curve["captured"], curve["held_gb"],\n'
                 '                         budget_gb=hbm_budget_gb, chosen_s=curve["chosen_s"],\n'
                 '                         router_s=curve["router_s"]), "ttl")'),
    ],
    "mode_choice": [
        ("markdown", "# Push, pull or bidirectional\nExpected TTFT p50/p99 per mode on this "
                     "traffic (the simulator calibrated with the measured floor and prefill cost), "
                     "and why the recommended mode wins."),
        ("code", LOAD),
        ("code", RECOMMEND + 'nb.publish("mode", tuning.mode.value)\n'
                 'nb.publish("expected_ttft_ms", tuning.mode.as_dict()["evidence"].get("expected_ttft_ms"))\n'
                 'print("\\n".join(tuning.mode.assumptions))\n'
                 'tuning.mode.as_dict()["evidence"]'),
        ("code", 'nb.show(plots.mode_ttft(tuning.mode.as_dict()["evidence"]["expected_ttft_ms"],\n'
                 '                        chosen=tuning.mode.value,\n'
                 '                        excluded=tuning.mode.as_dict()["evidence"].get("excluded")), "ttft")'),
    ],
    "stalls": [
        ("markdown", "# Stalls\nRequests and transfers that took over a second, next to fast ones: "
                     "which phase holds the stalled time (the analysis names it). Besides the "
                     "transfer phases: `queue_*` (API server -> scheduler, `kv.queue`), the "
                     "prefill, `handoff` (prefill done -> decode request arrived) and `dispatch` "
                     "(decode scheduler -> first transfer span). Time there, with short "
                     "transfer phases, means the engines waited for CPU (see the finding "
                     "`stalls_outside_transfer`)."),
        ("code", LOAD),
        ("code", 'from kvtune.analysis import stalls\n'
                 'diag = stalls.stall_diagnosis(tx, spans)\n'
                 'nb.publish("stall_share", diag.stalled_share)\n'
                 'nb.publish("stall_phase", diag.dominant_phase)\n'
                 'print(diag.summary)\n'
                 'diag.table'),
        ("code", 'nb.show(stalls.side_by_side_figure(diag), "side-by-side")'),
        ("code", 'if diag.slow_trace:\n'
                 '    nb.show(stalls.timeline_figure(diag, spans), "timeline")'),
        ("markdown", "Every millisecond of TTFT (router in -> the decode's first step), named: "
                     "waterfalls of the slowest requests and a typical one "
                     "(`kvtune.analysis.attribution`; grey: no span names it)."),
        ("code", 'from kvtune.analysis import attribution\n'
                 'table = attribution.request_attribution(spans)\n'
                 'nb.publish("ttft_named_share_p50", float(table["named_share"].median()) '
                 'if len(table) else None)\n'
                 'seg = attribution.segments(spans)\n'
                 'for tid in attribution.waterfall_requests(table):\n'
                 '    nb.show(plots.waterfall(seg, tid), f"waterfall-{tid[:12]}")'),
        ("markdown", "Share of TTFT per phase and serving mode: the median over the requests where "
                     "the phase appears, and its share of the mode's summed TTFT (what "
                     "`bench/attribution.py` prints; Grafana's per-phase panel sums whole span "
                     "durations instead, see docs/spans.md)."),
        ("code", 'shares = attribution.share_summary(attribution.phase_shares(spans))\n'
                 'nb.publish("ttft_phase_shares", shares.to_dict("records"))\n'
                 'shares.style.format({"share_p50": "{:.1%}", "share_total": "{:.1%}"})'
                 '.hide(axis="index")'),
    ],
    "tune": [
        ("markdown", "# Tune\nThe whole analysis end to end: recommendation with evidence, "
                     "and the config files vLLM and the router take as they are."),
        ("code", LOAD),
        ("code", RECOMMEND + 'from kvtune import export\n'
                 'served = export.model_name(model_name, spans=spans, geometry_model=model)\n'
                 'written = export.write(tuning, f"{out_dir}/configs", geometry=geometry, model=served,\n'
                 '                       overwrite=True)\n'
                 'nb.publish("kv_recompute_threshold", tuning.threshold.value)\n'
                 'nb.publish("decoder_kv_blocks_ttl", tuning.ttl.value)\n'
                 'nb.publish("mode", tuning.mode.value)\n'
                 'nb.publish("model_name", served.name)\n'
                 'print("written:", written, "model:", served.name, f"({served.source})")'),
        ("code", 'findings.FindingsView.of(tuning)'),
    ],
}


def build(name: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    cells = [nbformat.v4.new_code_cell(PARAMETERS, metadata={"tags": ["parameters"]})]
    for kind, text in NOTEBOOKS[name]:
        cell = (nbformat.v4.new_markdown_cell(text) if kind == "markdown"
                else nbformat.v4.new_code_cell(text))
        cells.append(cell)
    # Stable ids so regenerating gives identical files.
    for i, cell in enumerate(cells):
        cell["id"] = f"{name}-{i}"
    nb.cells = cells
    return nb


def render(name: str) -> str:
    return nbformat.writes(build(name)) + "\n"


def main(argv: list[str]) -> int:
    out = ROOT / "kvtune" / "notebooks"
    out.mkdir(exist_ok=True)
    for name in NOTEBOOKS:
        (out / f"{name}.ipynb").write_text(render(name))
    print(f"wrote {len(NOTEBOOKS)} notebooks to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
