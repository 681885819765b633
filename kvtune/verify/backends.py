"""Where the configurations run: a local vLLM pair restarted per configuration, or a cluster whose
instances the operator restarts (kvtune says with what) while a fresh router runs per configuration.

A backend's :meth:`deploy` is a context manager: inside it the instances serve ``config``, and it
yields their :class:`Upstreams` (what the router for that configuration forwards to, and whose
``/metrics`` say where prompt tokens came from and how much decode KV memory is held).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvtune.errors import ConfigError
from kvtune.router.config import InstanceConfig
from kvtune.verify.configs import VerifyConfig


@dataclass(frozen=True)
class Upstreams:
    prefill: tuple[InstanceConfig, ...]
    decode: tuple[InstanceConfig, ...]
    spans_dir: Path | None = None
    """Where the instances write their kvtune spans (OTLP-JSON lines), complete once the
    deployment is torn down; None: not known (a cluster's own telemetry)."""


class Backend(Protocol):
    description: str

    def deploy(self, config: VerifyConfig,
               workdir: Path) -> contextlib.AbstractContextManager[Upstreams]:
        ...


PairFactory = Callable[..., Any]
"""Makes a ``kvtune.local.LocalPair``-like context manager from keyword arguments (``mode``,
``recompute_threshold``, ``ttl_s``, ``workdir``, ``spans_dir`` and the backend's
``pair_kwargs``)."""


@dataclass
class LocalPairBackend:
    """A fresh local pair per configuration. ``pair_factory`` defaults to ``LocalPair``; pass
    another (or ``pair_kwargs`` such as ``connector``, ``layout`` or a fabric) to change how it
    is built."""

    pair_factory: PairFactory | None = None
    pair_kwargs: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""
    """Empty: says the pair and, on a shaped link, the link's name."""
    shaped_rate_mbit: float | None = None
    """Run each pair across a shaped link at this rate (``kvtune.local.fabric.ShapedLink``, as
    ``kvtune tune --fabric shaped:RATE`` does); None: loopback."""
    regime: str | None = None
    """The lab regime the pairs run in, for the description (``pair_kwargs['regime']`` builds
    it)."""

    def __post_init__(self) -> None:
        if not self.description:
            on = ""
            if self.shaped_rate_mbit is not None:
                from kvtune.local.fabric import FabricSpec
                on = f" on {FabricSpec(self.shaped_rate_mbit).name}"
            lab = f", lab regime {self.regime}" if self.regime else ""
            self.description = f"local vLLM pair{on}{lab} (restarted per configuration)"

    def with_regime(self, regime: Any) -> LocalPairBackend:
        """This backend with its pairs in another lab regime (``kvtune.local.regime``)."""
        name = getattr(regime, "name", str(regime))
        return dataclasses.replace(self, pair_kwargs={**self.pair_kwargs, "regime": regime},
                                   regime=name, description="")

    @contextlib.contextmanager
    def deploy(self, config: VerifyConfig, workdir: Path) -> Iterator[Upstreams]:
        factory = self.pair_factory
        if factory is None:
            from kvtune.local.pair import LocalPair
            factory = LocalPair
        kwargs = {**config.pair_kwargs(), "workdir": workdir / "pair",
                  "spans_dir": workdir / "spans", **dict(self.pair_kwargs)}
        with contextlib.ExitStack() as stack:
            if self.shaped_rate_mbit is not None:
                from kvtune.local.fabric import ShapedLink
                kwargs["fabric"] = stack.enter_context(ShapedLink(self.shaped_rate_mbit))
            yield from self._deploy(factory, kwargs)

    @staticmethod
    def _deploy(factory: Any, kwargs: dict[str, Any]) -> Iterator[Upstreams]:
        with factory(**kwargs) as pair:
            prefill = InstanceConfig(url=pair.prefill_url, engine_id=pair.prefill_engine_id,
                                     kv_port=pair.prefill_side_channel_port)
            spans = kwargs.get("spans_dir")
            yield Upstreams(prefill=(prefill,), decode=(InstanceConfig(url=pair.decode_url),),
                            spans_dir=Path(spans) if spans is not None else None)


def restart_instructions(config: VerifyConfig, upstreams: Upstreams) -> str:
    """What the operator changes on each instance before ``config`` is measured."""
    extra = json.dumps(config.kv_extra_config(), sort_keys=True) if config.kv_extra_config() \
        else "{} (remove kv_recompute_threshold, decoder_kv_blocks_ttl, bidirectional_kv_xfer)"
    connector = "NixlPushConnector" if config.mode == "push" else "NixlConnector"
    lines = [f"Configuration {config.name!r} ({config.source}): mode {config.mode}.",
             f"Restart every instance with kv_connector {connector} (or kvtune's instrumented "
             f"subclass) and kv_connector_extra_config {extra}:"]
    lines += [f"  prefill {i.url}" for i in upstreams.prefill]
    lines += [f"  decode  {i.url}" for i in upstreams.decode]
    return "\n".join(lines)


@dataclass
class ClusterBackend:
    """Instances the operator runs. Before each configuration :func:`restart_instructions` goes to
    ``confirm`` (the CLI prints it and waits for Enter, or only prints it with ``--no-wait``)."""

    prefill: Sequence[InstanceConfig]
    decode: Sequence[InstanceConfig]
    confirm: Callable[[VerifyConfig, str], None]
    description: str = "cluster (instances restarted by the operator per configuration)"

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ConfigError("verify cluster: expected at least one prefill and one decode URL")

    @contextlib.contextmanager
    def deploy(self, config: VerifyConfig, workdir: Path) -> Iterator[Upstreams]:
        ups = Upstreams(tuple(self.prefill), tuple(self.decode))
        self.confirm(config, restart_instructions(config, ups))
        yield ups
