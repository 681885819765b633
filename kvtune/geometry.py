"""KV-cache geometry: how many bytes a token's KV takes per rank, and how vLLM lays them out.

vLLM (FlashAttention-style backends, as its NIXL connector registers them) keeps, per layer, a K
region and a V region, each ``num_blocks`` blocks of ``block_size_tokens`` tokens. One block of one
region is ``block_size_tokens * kv_heads_per_rank * head_dim * dtype_bytes`` bytes. The connector
registers one descriptor per region per block and a transfer names one descriptor per layer per K/V
per block (:attr:`~kvtune.spans.Layout.PER_BLOCK`); a transfer of contiguous blocks could instead
name one descriptor per region (:attr:`~kvtune.spans.Layout.MERGED`).

The buffer layout used here (region ``r = 2 * layer + kv``, ``kv`` 0 for K and 1 for V) is::

    offset(region r, block j) = r * capacity_blocks * block_bytes + j * block_bytes
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtune.errors import ConfigError
from kvtune.spans import Layout

DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float": 4, "fp32": 4,
    "float16": 2, "half": 2, "fp16": 2,
    "bfloat16": 2, "bf16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "float8": 1,
}
"""Bytes per element of the ``torch_dtype`` names found in Hugging Face configs."""

DEFAULT_BLOCK_SIZE_TOKENS = 16
"""vLLM's default KV block size on GPU."""


@dataclass(frozen=True)
class KvGeometry:
    """Shape of one model's KV cache on one tensor-parallel rank.

    When ``tp_size`` exceeds ``kv_heads``, vLLM replicates KV heads so each rank still holds one.
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
    tp_size: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_dim", "dtype_bytes", "block_size_tokens", "tp_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"KvGeometry{f' {self.name!r}' if self.name else ''}: field {field!r}: "
                                  f"expected an integer >= 1, got {value!r}")
        if self.kv_heads >= self.tp_size and self.kv_heads % self.tp_size:
            raise ConfigError(f"KvGeometry {self.name!r}: field 'tp_size': expected a divisor of "
                              f"kv_heads={self.kv_heads} (or a multiple of it), got {self.tp_size}")

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads one rank holds (at least one: replicated when ``tp_size > kv_heads``)."""
        return max(1, self.kv_heads // self.tp_size)

    @property
    def regions(self) -> int:
        """Registered regions: one K and one V region per layer."""
        return 2 * self.layers

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token on one rank (all layers, K and V)."""
        return self.regions * self.kv_heads_per_rank * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one region (one layer's K or V): the per-block descriptor length."""
        return self.block_size_tokens * self.kv_heads_per_rank * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block on one rank (all layers, K and V)."""
        return self.regions * self.block_bytes

    def blocks(self, tokens: int) -> int:
        """Blocks holding ``tokens`` tokens (a partly filled last block moves whole)."""
        _check_tokens(tokens)
        return math.ceil(tokens / self.block_size_tokens)

    def transfer_bytes(self, tokens: int) -> int:
        """Bytes one rank moves for ``tokens`` tokens (whole blocks)."""
        return self.blocks(tokens) * self.bytes_per_block

    def buffer_bytes(self, capacity_blocks: int) -> int:
        """Bytes of a KV buffer of ``capacity_blocks`` blocks per region."""
        return capacity_blocks * self.bytes_per_block

    def descriptor_count(self, tokens: int, layout: Layout | str) -> int:
        """Descriptors one transfer of ``tokens`` tokens names in ``layout``."""
        layout = parse_layout(layout)
        if layout is Layout.MERGED:
            return self.regions
        return self.regions * self.blocks(tokens)

    def descriptors(self, tokens: int, layout: Layout | str, *,
                    capacity_blocks: int | None = None) -> np.ndarray:
        """``(offset, length)`` rows, in bytes from the buffer start, for a transfer of ``tokens``
        tokens in blocks ``0..blocks-1`` of every region of a buffer of ``capacity_blocks`` blocks
        per region (default: just enough). Region-major, then block order, as vLLM lists them."""
        layout = parse_layout(layout)
        n_blocks = self.blocks(tokens)
        capacity = n_blocks if capacity_blocks is None else capacity_blocks
        if capacity < n_blocks:
            raise ConfigError(f"KvGeometry.descriptors: field 'capacity_blocks': expected >= "
                              f"{n_blocks} blocks for {tokens} tokens, got {capacity}")
        region_starts = np.arange(self.regions, dtype=np.int64) * capacity * self.block_bytes
        if layout is Layout.MERGED:
            lengths = np.full(self.regions, n_blocks * self.block_bytes, dtype=np.int64)
            return np.column_stack([region_starts, lengths])
        block_offsets = np.arange(n_blocks, dtype=np.int64) * self.block_bytes
        offsets = (region_starts[:, None] + block_offsets[None, :]).ravel()
        return np.column_stack([offsets, np.full(offsets.shape, self.block_bytes, dtype=np.int64)])

    def as_dict(self) -> dict:
        return {"name": self.name, "layers": self.layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "dtype_bytes": self.dtype_bytes,
                "block_size_tokens": self.block_size_tokens, "tp_size": self.tp_size,
                "bytes_per_token": self.bytes_per_token}


def _check_tokens(tokens: int) -> None:
    if not isinstance(tokens, (int, np.integer)) or isinstance(tokens, bool) or tokens < 1:
        raise ConfigError(f"tokens: expected an integer >= 1, got {tokens!r}")


def parse_layout(layout: Layout | str) -> Layout:
    """A :class:`~kvtune.spans.Layout` from its value, with an error naming the choices."""
    try:
        return Layout(layout)
    except ValueError:
        raise ConfigError(f"layout: expected one of {[x.value for x in Layout]}, got {layout!r}") from None


PRESETS: dict[str, KvGeometry] = {
    g.name: g for g in (
        KvGeometry(64, 8, 128, 2, name="qwen3-32b"),
        KvGeometry(36, 8, 128, 2, name="qwen3-8b"),
        KvGeometry(28, 8, 128, 2, name="qwen3-0.6b"),
        KvGeometry(80, 8, 128, 2, name="llama-3.1-70b"),
        KvGeometry(32, 8, 128, 2, name="llama-3.1-8b"),
        KvGeometry(2, 2, 64, 2, name="tiny"),
    )
}
"""Model presets (per-model KV shape; ``tiny`` is a toy shape for tests and quick checks)."""


def preset(name: str, tp_size: int = 1, *, block_size_tokens: int | None = None) -> KvGeometry:
    """The geometry of a preset model at ``tp_size``."""
    try:
        g = PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"model preset: expected one of {sorted(PRESETS)}, got {name!r} "
                          f"(or pass a local config.json)") from None
    return KvGeometry(g.layers, g.kv_heads, g.head_dim, g.dtype_bytes,
                      block_size_tokens or g.block_size_tokens, tp_size, g.name)


def from_hf_config(path: str | Path, tp_size: int = 1, *,
                   block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS) -> KvGeometry:
    """Geometry from a local Hugging Face ``config.json`` (or the directory holding one).

    Reads ``num_hidden_layers``, ``num_key_value_heads`` (default ``num_attention_heads``),
    ``head_dim`` (default ``hidden_size / num_attention_heads``) and ``torch_dtype`` (or ``dtype``);
    multimodal configs with a ``text_config`` are read from it.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: model config not found") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p}: expected a JSON model config: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a JSON object at top level, got {type(raw).__name__}")
    cfg = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw

    def need_int(field: str, value: object) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{p}: field {field!r}: expected an integer >= 1, got {value!r}")
        return value

    if "num_hidden_layers" not in cfg:
        raise ConfigError(f"{p}: field 'num_hidden_layers': expected an integer >= 1, missing")
    layers = need_int("num_hidden_layers", cfg["num_hidden_layers"])
    attn_heads = cfg.get("num_attention_heads")
    kv_heads_raw = cfg.get("num_key_value_heads", attn_heads)
    if kv_heads_raw is None:
        raise ConfigError(f"{p}: field 'num_key_value_heads': expected an integer >= 1 (or "
                          f"'num_attention_heads'), missing")
    kv_heads = need_int("num_key_value_heads", kv_heads_raw)
    if cfg.get("head_dim") is not None:
        head_dim = need_int("head_dim", cfg["head_dim"])
    else:
        hidden = cfg.get("hidden_size")
        if hidden is None or attn_heads is None:
            raise ConfigError(f"{p}: field 'head_dim': expected an integer >= 1 (or 'hidden_size' "
                              f"and 'num_attention_heads'), missing")
        hidden = need_int("hidden_size", hidden)
        attn_heads = need_int("num_attention_heads", attn_heads)
        if hidden % attn_heads:
            raise ConfigError(f"{p}: field 'hidden_size': expected a multiple of "
                              f"num_attention_heads={attn_heads}, got {hidden}")
        head_dim = hidden // attn_heads
    dtype_field = "torch_dtype" if "torch_dtype" in cfg else "dtype"
    dtype = cfg.get(dtype_field, raw.get("torch_dtype", raw.get("dtype")))
    if dtype is None:
        raise ConfigError(f"{p}: field 'torch_dtype': expected one of {sorted(DTYPE_BYTES)}, missing")
    dtype_name = str(dtype).removeprefix("torch.").lower()
    if dtype_name not in DTYPE_BYTES:
        raise ConfigError(f"{p}: field {dtype_field!r}: expected one of {sorted(DTYPE_BYTES)}, "
                          f"got {dtype!r}")
    name = str(raw.get("_name_or_path") or p.parent.name or p.stem)
    return KvGeometry(layers, kv_heads, head_dim, DTYPE_BYTES[dtype_name], block_size_tokens,
                      tp_size, name)
