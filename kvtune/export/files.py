"""Files vLLM and the router take as they are, written from a :class:`~kvtune.recommend.Tuning`.

``write(tuning, out_dir)`` makes, all at once (a temporary directory renamed into place, so the
directory appears complete or not at all):

- ``prefill.kv-transfer-config.json``, ``decode.kv-transfer-config.json``: the ``--kv-transfer-config``
  values (keys as vLLM 0.32's ``KVTransferConfig`` and NIXL connector read them:
  ``kv_connector_extra_config.kv_recompute_threshold`` / ``decoder_kv_blocks_ttl`` /
  ``bidirectional_kv_xfer``, and ``kv_lease_duration`` (both roles) when the recommended one
  differs from vLLM's default 30 s, see ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py``);
- ``prefill.vllm-serve.args``, ``decode.vllm-serve.args``: the arguments of ``vllm serve``, one per
  line, no spaces inside (``mapfile -t A < prefill.vllm-serve.args; vllm serve "${A[@]}"``);
- ``router.yaml``: the kvtune router's configuration (``kvtune.router.config`` keys);
- ``recommendation.json``: values, ranges, evidence, findings, fit quality, provenance (the
  vLLM and NIXL releases the trace was measured on, from its resources);
- ``REPORT.md``: a short human summary;
- ``.kvtune-export``: the marker saying kvtune wrote this directory (``--force`` replaces only such).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from kvtune import __version__
from kvtune import spans as sc
from kvtune import vllm_pd
from kvtune.errors import ConfigError
from kvtune.export.model import PLACEHOLDER, ModelName, name_problem
from kvtune.recommend.evidence import JsonEvidence, ModeEvidence, ThresholdEvidence, TtlEvidence
from kvtune.recommend.results import NEVER, Tuning
from kvtune.recommend.retention import POLICY_FIXED_TTL, POLICY_LEASE
from kvtune.vllm_pd import router_margin_s

EXPORT_MARKER = ".kvtune-export"
"""The file :func:`write` puts in every export it makes: ``--force`` replaces only a directory
holding it (a copied ``recommendation.json`` alone does not make a directory an export)."""
MARKER_CONTENT = {"written_by": "kvtune export"}
"""What :data:`EXPORT_MARKER` holds (JSON, with the kvtune version added)."""
FILES: tuple[str, ...] = (
    "prefill.kv-transfer-config.json", "decode.kv-transfer-config.json",
    "prefill.vllm-serve.args", "decode.vllm-serve.args", "router.yaml", "recommendation.json",
    "REPORT.md", EXPORT_MARKER,
)
"""Every file :func:`write` makes, in the order it makes them."""

NEVER_THRESHOLD_TOKENS = 2**31 - 1
"""``kv_recompute_threshold`` written when reuse never pays: every history is below it (recompute)."""
DEFAULT_PREFILL_URL = "http://PREFILL_HOST:8100"
DEFAULT_DECODE_URL = "http://DECODE_HOST:8200"
PREFILL_ENGINE_ID = "kvtune-prefill-0"
"""Fixed prefill engine id: the push router names the prefill up front."""


def threshold_tokens(tuning: Tuning) -> int:
    """The ``kv_recompute_threshold`` to write (``NEVER`` -> :data:`NEVER_THRESHOLD_TOKENS`)."""
    v = tuning.threshold.value
    return NEVER_THRESHOLD_TOKENS if v == NEVER else int(v)


def kv_transfer_configs(tuning: Tuning, *, connector: str = "kvtune",
                        kv_buffer_device: str | None = None,
                        extra: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """``{"prefill": {...}, "decode": {...}}``: the two ``--kv-transfer-config`` values.

    Each names its server's role (``kv_producer`` / ``kv_consumer``): the files are one per role,
    and that is what vLLM asks of its NIXL connector (it logs ``kv_both`` as deprecated there).
    An engine started with ``kv_both`` instead gets the same spans (kvtune's connectors label each
    span with its request's leg), so either works."""
    mode = str(tuning.mode.value)
    if connector not in vllm_pd.CONNECTOR_FAMILIES or mode not in vllm_pd.MODES:
        raise ConfigError(f"export: connector {connector!r} / mode {mode!r}: expected connector in "
                          f"{sorted(vllm_pd.CONNECTOR_FAMILIES)} and mode in {sorted(vllm_pd.MODES)}")
    bidi = mode == sc.Mode.BIDIRECTIONAL.value
    ttl = int(tuning.ttl.value)
    out: dict[str, dict[str, Any]] = {}
    for role in ("prefill", "decode"):
        ex: dict[str, Any] = {vllm_pd.KV_RECOMPUTE_THRESHOLD: threshold_tokens(tuning),
                              vllm_pd.BIDIRECTIONAL_KV_XFER: bidi}
        # vLLM's push connector also uses the TTL as its registration timeout: never write 0 there.
        if bidi or ttl > 0:
            ex[vllm_pd.DECODER_KV_BLOCKS_TTL] = ttl
        lease = prefill_lease_s(tuning)
        if lease is not None:  # both: the decode heartbeats every lease // 6 s (base_scheduler)
            ex[vllm_pd.KV_LEASE_DURATION] = lease
        if role == "decode" and connector == "kvtune" and _lease(tuning) is not None:
            ex[vllm_pd.LEASE_PORT] = 0  # the lease channel on any free loopback port
        ex.update(extra or {})
        out[role] = vllm_pd.kv_transfer_config(
            role, mode, connector=connector, kv_buffer_device=kv_buffer_device, extra_config=ex,
            engine_id=PREFILL_ENGINE_ID if role == "prefill" and mode == sc.Mode.PUSH.value
            else None)
    return out


def prefill_lease_s(tuning: Tuning) -> int | None:
    """The recommended ``kv_lease_duration`` (``tuning.extra``, :mod:`kvtune.recommend.prefill_lease`)
    when it differs from vLLM's default; else None (nothing to write)."""
    rec = tuning.extra.get(vllm_pd.KV_LEASE_DURATION)
    if not isinstance(rec, dict) or rec.get("value") is None:
        return None
    value = int(rec["value"])
    return None if value == vllm_pd.DEFAULT_KV_LEASE_DURATION_S else value


def serve_args(model: str, kv_config: dict[str, Any], *, port: int, geometry: Any = None,
               extra_args: tuple[str, ...] = ()) -> list[str]:
    """``vllm serve`` arguments (one token each; the JSON is compact, without spaces)."""
    problem = name_problem(model)
    if problem is not None:
        raise ConfigError(f"export: field 'model': expected a model name or path {problem}")
    args = [model, "--port", str(int(port)),
            "--kv-transfer-config", json.dumps(kv_config, separators=(",", ":"), sort_keys=True)]
    if geometry is not None:
        args += ["--block-size", str(int(geometry.block_size_tokens)),
                 "--tensor-parallel-size", str(int(geometry.tp_size))]
    args += list(extra_args)
    bad = [a for a in args if any(c.isspace() for c in a)]
    if bad:
        raise ConfigError(f"export: serve arguments must not contain whitespace, got {bad[:3]}")
    return args


def router_config(tuning: Tuning, *, prefill_url: str, decode_url: str,
                  side_channel_port: int = vllm_pd.DEFAULT_SIDE_CHANNEL_PORT) -> dict[str, Any]:
    """The router's configuration (``kvtune.router.config`` keys)."""
    mode = str(tuning.mode.value)
    prefill: dict[str, Any] = {"url": prefill_url}
    if mode == sc.Mode.PUSH.value:
        prefill.update(engine_id=PREFILL_ENGINE_ID, kv_port=int(side_channel_port))
    cfg: dict[str, Any] = {"mode": mode, "prefill": [prefill], "decode": [{"url": decode_url}]}
    ttl = float(tuning.ttl.value)
    if mode == sc.Mode.BIDIRECTIONAL.value and ttl > 0:
        cfg["decoder_ttl_s"] = ttl
        cfg["margin_s"] = router_margin_s(ttl)
        lease = _lease(tuning)
        if lease is not None:
            cfg["lease_s"], cfg["lease_renew_every_s"], cfg["lease_idle_s"] = lease
    return cfg


def _lease(tuning: Tuning) -> tuple[float, float, float] | None:
    """(lease_s, renew_every_s, idle_s) when the renewable decode lease is recommended
    (``tuning.retention``, bidirectional mode only); else None."""
    r = tuning.retention
    if (not r or r.get("policy") != POLICY_LEASE
            or str(tuning.mode.value) != sc.Mode.BIDIRECTIONAL.value):
        return None
    return float(r["lease_s"]), float(r["renew_every_s"]), float(r["idle_s"])


def _versions_line(tuning: Tuning) -> str:
    """The releases the trace ran on, from its spans' resources (every one seen)."""
    versions = tuning.extra.get("versions") or {}
    parts = [f"{label} {' + '.join(versions[key])}" for key, label in (("vllm", "vLLM"),
                                                                        ("nixl", "NIXL"))
             if versions.get(key)]
    return f"Measured on {', '.join(parts)}." if parts else "The trace does not name its vLLM/NIXL."


def _report(tuning: Tuning, model: ModelName, files: dict[str, str]) -> str:
    t, ttl, m = tuning.threshold, tuning.ttl, tuning.mode
    fit = tuning.fit
    lines = [
        "# kvtune recommendation", "",
        f"Trace: `{tuning.source}` ({tuning.span_count} spans). Model: `{model.name}` "
        f"({model.source}). kvtune {__version__}. {_versions_line(tuning)}", "",
        "| setting | value | plausible range |", "|---|---|---|",
        f"| mode | **{m.value}** | {m.range[0]} / {m.range[1]} |",
        f"| kv_recompute_threshold | **{t.value}** {t.unit} | {t.range[0]} .. {t.range[1]} |",
        f"| decoder_kv_blocks_ttl | **{ttl.value}** {ttl.unit} | {ttl.range[0]} .. {ttl.range[1]} |",
    ]
    lease = tuning.extra.get(vllm_pd.KV_LEASE_DURATION)
    if isinstance(lease, dict):
        lines.append(f"| kv_lease_duration | **{lease['value']}** {lease['unit']} | "
                     f"{lease['range'][0]} .. {lease['range'][1]} |")
    lines += [
        "",
    ]
    if fit is not None:
        desc = (f", {fit.per_descriptor_us:.3g} us/descriptor" if fit.per_descriptor_us is not None
                else "")
        lines += [f"Fabric fit ({fit.n_transfers} transfers, {fit.n_sizes} sizes, R^2 {fit.r2:.3f}): "
                  f"floor {fit.floor_ms:.3g} ms [{fit.floor_ci_ms[0]:.3g}, {fit.floor_ci_ms[1]:.3g}], "
                  f"bandwidth {fit.bandwidth_gbps:.3g} Gbit/s [{fit.bandwidth_ci_gbps[0]:.3g}, "
                  f"{fit.bandwidth_ci_gbps[1]:.3g}]{desc}.", ""]
    why = []
    te = t.evidence
    if (isinstance(te, (ThresholdEvidence, JsonEvidence)) and te.break_even_tokens is not None
            and te.pull_ms_at_break_even is not None):
        why.append(f"- threshold: pulling {te.break_even_tokens:.0f} tokens back costs "
                   f"{te.pull_ms_at_break_even:.3g} ms, as much as recomputing them; longer "
                   f"histories are pulled, shorter ones recomputed.")
    elif t.value == NEVER:
        why.append("- threshold: pulling history back never costs less than recomputing it on "
                   "this traffic.")
    ev = ttl.evidence
    if isinstance(ev, (TtlEvidence, JsonEvidence)) and ev.retained_gb_at_ttl is not None:
        gap50 = ev.gap_s_p50 if ev.gap_s_p50 is not None else float("nan")
        gap90 = ev.gap_s_p90 if ev.gap_s_p90 is not None else float("nan")
        why.append(f"- TTL: captures {ev.captured_share:.0%} of reusable next-turn history "
                   f"(gap p50 {gap50:.3g} s, p90 {gap90:.3g} s) holding about "
                   f"{ev.retained_gb_at_ttl:.3g} GB of decode HBM (budget "
                   f"{ev.hbm_budget_gb} GB); the router's TTL is "
                   f"{ev.router_params_ttl_s} s.")
    why += _retention_lines(tuning)
    if why:
        lines += ["Why:", "", *why, ""]
    if m.value != sc.Mode.BIDIRECTIONAL.value:
        lines += [f"In {m.value} mode bidirectional KV transfer is off: the threshold and TTL only "
                  f"act with it, and are written for reference.", ""]
    me = m.evidence
    if isinstance(me, (ModeEvidence, JsonEvidence)) and me.expected_ttft_ms:
        lines += [f"Expected TTFT ({me.model} model):", ""]
        lines += [f"- {mode}: p50 {v.p50:.1f} ms, p99 {v.p99:.1f} ms"
                  for mode, v in me.expected_ttft_ms.items()]
        lines.append("")
    if isinstance(me, (ModeEvidence, JsonEvidence)) and me.sim_inputs:
        lines += ["Simulator inputs (value: source):", ""]
        lines += [f"- `{i.name}` = {i.value}: {i.source}" for i in me.sim_inputs]
        lines.append("")
    if t.value == NEVER:
        lines += [f"Reuse never pays: `kv_recompute_threshold` is written as {NEVER_THRESHOLD_TOKENS} "
                  f"(always recompute) and bidirectional transfer is off.", ""]
    if tuning.findings:
        lines += ["## Findings", ""]
        lines += [f"- **{f.severity}** `{f.code}`: {f.message}" for f in tuning.findings]
        lines.append("")
    if not model.known:
        lines += [f"**Model name unknown**: the args files say `{PLACEHOLDER}`; replace it with the "
                  f"model's name or path, or re-run with `--model NAME`.", ""]
    lines += ["## Apply", "",
              "```sh",
              f'mapfile -t A < {files["prefill_args"]}; vllm serve "${{A[@]}}"   # prefill host',
              f'mapfile -t A < {files["decode_args"]}; vllm serve "${{A[@]}}"    # decode host',
              "kvtune router --config router.yaml   # replace PREFILL_HOST / DECODE_HOST first",
              "```", ""]
    if m.value == sc.Mode.PUSH.value:
        lines += ["Push mode: start the prefill with `VLLM_NIXL_SIDE_CHANNEL_PORT` equal to "
                  "`kv_port` in router.yaml.", ""]
    lines += ["Assumptions and evidence: `recommendation.json`.", ""]
    return "\n".join(lines)


def _retention_lines(tuning: Tuning) -> list[str]:
    """REPORT.md's lines on fixed TTL vs the renewable lease (``tuning.retention``)."""
    r = tuning.retention
    if not r:
        return []
    bs, cs = r["block_s"], r["captured_share"]

    def share(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.0%}"

    lines = [f"- retention: **{r['policy']}** ({r['evidence'].get('why')}). Over the traced "
             f"conversations ({share(r['evidence'].get('ended_share'))} ended explicitly) the "
             f"fixed TTL {r['ttl_s']:g} s holds {bs[POLICY_FIXED_TTL]:.3g} decode block-s and "
             f"captures {share(cs[POLICY_FIXED_TTL])} of reusable history; the renewable lease "
             f"{bs[POLICY_LEASE]:.3g} block-s, capturing {share(cs[POLICY_LEASE])}."]
    if r["policy"] == POLICY_LEASE:
        from kvtune.router.lease import END_HEADER, END_PATH  # aiohttp: only when needed
        lines.append(f"  router.yaml renews every {r['renew_every_s']:.3g} s for "
                     f"{r['lease_s']:.3g} s while the conversation is live (up to "
                     f"{r['idle_s']:.3g} s after its last turn); clients should end conversations "
                     f"explicitly (`{END_HEADER}: 1` on the last turn, or `POST {END_PATH}`).")
    return lines


def _write_text(d: Path, name: str, text: str) -> None:
    with open(d / name, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _check_replaceable(out: Path, overwrite: bool) -> None:
    """Refuses to replace anything but a directory kvtune's export wrote (it holds
    :data:`EXPORT_MARKER`), and that only with ``overwrite``: ``--force`` pointed at a home or
    source directory, or at one that merely holds a copied ``recommendation.json``, deletes
    nothing."""
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise ConfigError(f"export: {out} exists; pass overwrite=True (--force) to replace it")
    if out.is_symlink() or not out.is_dir():
        raise ConfigError(f"export: {out} exists and is not a directory (a file or a link); "
                          f"refusing to replace it even with --force: choose another output")
    marker = out / EXPORT_MARKER
    try:
        found = (None if marker.is_symlink() or not marker.is_file()
                 else json.loads(marker.read_text(encoding="utf-8")))
    except (OSError, ValueError, RecursionError):
        found = None
    if not (isinstance(found, dict)
            and all(found.get(k) == v for k, v in MARKER_CONTENT.items())):
        raise ConfigError(f"export: {out} exists and holds no {EXPORT_MARKER} marker written by "
                          f"kvtune export, so it is not a previous export (a copied "
                          f"recommendation.json does not make it one); refusing to replace it "
                          f"even with --force: choose another output directory or empty it "
                          f"yourself")


def _swap(new: Path, out: Path, between: Callable[[Path], None] | None) -> None:
    """Puts ``new`` in the place of the existing ``out``: ``out`` is moved aside first and moved
    back if ``new`` cannot take its place, so a failure leaves the previous export as it was."""
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    kept = old / "dir"
    os.rename(out, kept)
    try:
        if between is not None:
            between(out)
        os.rename(new, out)
    except BaseException as exc:
        try:
            os.rename(kept, out)
        except OSError as back:
            raise ConfigError(f"export: replacing {out} failed ({exc}) and putting the previous "
                              f"export back failed too ({back.strerror or back}): it is kept in "
                              f"{kept}") from exc
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write(tuning: Tuning, out_dir: str | os.PathLike[str], *, geometry: Any = None,
          model: str | ModelName | None = None, prefill_url: str = DEFAULT_PREFILL_URL,
          decode_url: str = DEFAULT_DECODE_URL, prefill_port: int = 8100, decode_port: int = 8200,
          connector: str = "kvtune", kv_buffer_device: str | None = None,
          side_channel_port: int = vllm_pd.DEFAULT_SIDE_CHANNEL_PORT, overwrite: bool = False,
          _before_commit: Callable[[Path], None] | None = None,
          _between_renames: Callable[[Path], None] | None = None) -> Path:
    """Write :data:`FILES` into ``out_dir`` atomically (see module doc) and return its path.

    An existing ``out_dir`` is refused unless ``overwrite``, and even then unless it is a directory
    holding a previous export (its ``recommendation.json``); it is then replaced whole, or, if the
    replacement fails, left as it was. ``_before_commit`` is a test hook called with the filled
    temporary directory just before it is renamed; ``_between_renames`` with ``out_dir`` once the
    previous export is moved aside and before the new one takes its place.
    ``model``: the name for ``vllm serve`` (a :class:`~kvtune.export.model.ModelName` says where it
    came from); None writes the placeholder ``MODEL`` and says so in REPORT.md.
    """
    if not isinstance(model, ModelName):
        model = (ModelName(model, "given") if model else
                 ModelName(PLACEHOLDER, f"unknown: no model name given; replace {PLACEHOLDER} in "
                                        f"the args files"))
    out = Path(os.path.abspath(out_dir))  # `--out .` names the directory, not ""
    _check_replaceable(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"export: cannot create {out.parent}: {exc.strerror or exc}") from None
    kv = kv_transfer_configs(tuning, connector=connector, kv_buffer_device=kv_buffer_device)
    args = {"prefill": serve_args(model.name, kv["prefill"], port=prefill_port, geometry=geometry),
            "decode": serve_args(model.name, kv["decode"], port=decode_port, geometry=geometry)}
    router = router_config(tuning, prefill_url=prefill_url, decode_url=decode_url,
                           side_channel_port=side_channel_port)
    rec = {
        "kvtune_version": __version__, "convention": sc.CONVENTION_VERSION,
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model.name, "model_source": model.source, "trace_source": tuning.source,
        "span_count": tuning.span_count, "versions": tuning.extra.get("versions") or {},
        "fit_quality": ({"r2": tuning.fit.r2, "n_transfers": tuning.fit.n_transfers,
                         "n_sizes": tuning.fit.n_sizes, "n_outliers": tuning.fit.n_outliers}
                        if tuning.fit is not None else None),
        "written": {vllm_pd.KV_RECOMPUTE_THRESHOLD: threshold_tokens(tuning),
                    vllm_pd.DECODER_KV_BLOCKS_TTL: int(tuning.ttl.value),
                    "mode": str(tuning.mode.value),
                    "connector": kv["prefill"][vllm_pd.KV_CONNECTOR],
                    **({vllm_pd.KV_LEASE_DURATION: prefill_lease_s(tuning)}
                       if prefill_lease_s(tuning) is not None else {})},
        "recommendations": {**{r.name: r.as_dict()
                               for r in (tuning.threshold, tuning.ttl, tuning.mode)},
                            **({vllm_pd.KV_LEASE_DURATION: tuning.extra[vllm_pd.KV_LEASE_DURATION]}
                               if isinstance(tuning.extra.get(vllm_pd.KV_LEASE_DURATION), dict)
                               else {})},
        **tuning.as_dict(),
        "files": list(FILES),
    }
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as exc:
        raise ConfigError(f"export: cannot write in {out.parent}: {exc.strerror or exc}") from None
    try:
        _write_text(tmp, FILES[0], json.dumps(kv["prefill"], indent=2, sort_keys=True) + "\n")
        _write_text(tmp, FILES[1], json.dumps(kv["decode"], indent=2, sort_keys=True) + "\n")
        _write_text(tmp, FILES[2], "\n".join(args["prefill"]) + "\n")
        _write_text(tmp, FILES[3], "\n".join(args["decode"]) + "\n")
        _write_text(tmp, FILES[4], yaml.safe_dump(router, sort_keys=False))
        _write_text(tmp, FILES[5], json.dumps(rec, indent=2, allow_nan=False) + "\n")
        _write_text(tmp, FILES[6], _report(tuning, model, {"prefill_args": FILES[2],
                                                           "decode_args": FILES[3]}))
        _write_text(tmp, EXPORT_MARKER, json.dumps({**MARKER_CONTENT,
                                                    "kvtune_version": __version__}) + "\n")
        os.chmod(tmp, 0o755)
        if _before_commit is not None:
            _before_commit(tmp)
        if out.exists() or out.is_symlink():
            _swap(tmp, out, _between_renames)
        else:
            os.rename(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise ConfigError(f"export: cannot write {out}: {exc.strerror or exc}") from exc
        raise
    return Path(out_dir)
