"""What one P/D transfer moves, from the model's KV layout and the stack's cache.

Prefill pushes whole blocks (``block_size`` tokens, the cache's logical block)
of every registered region: the target's MLA latent layers (kv_lora_rank +
qk_rope_head_dim values per token) or its GQA layers (K and V of each KV
head), and the Eagle3 draft's GQA layers. A transfer of any other size means
a region is missing, duplicated or mis-sized.

Nothing here is a constant of one stack: the block size and element type come
from the server under test (``vllm:cache_config_info``,
``vllm:mooncake_kv_cache_info``) or from the GPU preflight's prediction, the
shapes from the models' ``config.json``. The preflight and the e2e suite both
call :func:`layout`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_mooncake import metric_names

# The plugin's names for the two layouts (its region report and
# vllm:mooncake_region_bytes_total{layout}).
MLA = metric_names.MLA_LAYOUT
GQA = metric_names.GQA_LAYOUT

# Bytes per element of vLLM's dtype and kv-cache-dtype names.
DTYPE_BYTES = {
    **dict.fromkeys(("float32", "float"), 4),
    **dict.fromkeys(("bfloat16", "float16", "half"), 2),
    **dict.fromkeys(("fp8", "fp8_e4m3", "fp8_e5m2"), 1),
}


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class Region:
    """Layers of one layout, each holding ``bytes_per_token`` per token."""

    model: str
    layout: str
    layers: int
    bytes_per_token: int


@dataclass(frozen=True)
class KVLayout:
    block_size: int
    regions: tuple[Region, ...]
    kv_dtype: str

    @property
    def layers(self) -> int:
        """Every region's layers: the per-layer regions a transfer covers."""
        return sum(r.layers for r in self.regions)

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def bytes_per_block(self, layout: str | None = None) -> int:
        return sum(
            r.layers * r.bytes_per_token * self.block_size
            for r in self.regions
            if layout is None or r.layout == layout
        )

    def transfer_bytes(self, tokens: int, layout: str | None = None) -> int:
        """Bytes of one transfer of ``tokens`` prompt tokens (whole blocks)."""
        return self.blocks(tokens) * self.bytes_per_block(layout)


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (multimodal wrappers nest it)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def is_mla(config: Mapping[str, Any]) -> bool:
    return bool(text_config(config).get("kv_lora_rank"))


def head_dim(config: Mapping[str, Any]) -> int:
    c = text_config(config)
    return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


def mla_head_size(config: Mapping[str, Any]) -> int:
    """What MLA caches per token and layer: the latent plus the RoPE part."""
    c = text_config(config)
    return int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"])


def kv_heads(config: Mapping[str, Any]) -> int:
    c = text_config(config)
    return int(c.get("num_key_value_heads") or c["num_attention_heads"])


def _region(model: str, config: Mapping[str, Any], element: int, tp: int) -> Region:
    c = text_config(config)
    layers = int(c["num_hidden_layers"])
    if is_mla(c):
        # The latent is not split over tensor-parallel ranks: each rank keeps,
        # registers and sends its own copy.
        return Region(model, MLA, layers, mla_head_size(c) * element * tp)
    # KV heads are split over ranks, and replicated when there are fewer.
    per_rank = max(1, kv_heads(c) // tp)
    return Region(model, GQA, layers, 2 * per_rank * head_dim(c) * element * tp)


def layout(
    target: Mapping[str, Any],
    draft: Mapping[str, Any] | None,
    kv_dtype: str,
    block_size: int,
    tensor_parallel_size: int = 1,
) -> KVLayout:
    """The regions prefill registers for a target (and an Eagle draft)."""
    if block_size <= 0:
        raise LayoutError(f"block size must be positive, got {block_size}")
    name = str(kv_dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise LayoutError(
            f"KV element type {kv_dtype!r} has no known size; known: "
            f"{', '.join(sorted(DTYPE_BYTES))}"
        )
    element = DTYPE_BYTES[name]
    regions = [_region("target", target, element, tensor_parallel_size)]
    if draft is not None:
        regions.append(_region("draft", draft, element, tensor_parallel_size))
    return KVLayout(block_size, tuple(regions), name)


def served(
    cache_info: Mapping[str, str],
    kv_info: Mapping[str, str],
    target: Mapping[str, Any],
    draft: Mapping[str, Any] | None,
) -> KVLayout:
    """The layout a running server transfers, from the labels of its
    ``vllm:cache_config_info`` (the engine's block size, after vLLM chose it
    for its attention backends) and the plugin's ``vllm:mooncake_kv_cache_info``
    (the KV element type with "auto" resolved, the tensor-parallel width)."""
    missing = [
        name
        for name, labels, key in (
            ("vllm:cache_config_info", cache_info, "block_size"),
            ("vllm:mooncake_kv_cache_info", kv_info, "kv_cache_dtype"),
        )
        if not labels.get(key)
    ]
    if missing:
        raise LayoutError(
            f"the server's /metrics lacks {' and '.join(missing)} (is the "
            "PDMooncakeConnector plugin installed and the connector configured?)"
        )
    return layout(
        target,
        draft,
        kv_info["kv_cache_dtype"],
        int(cache_info["block_size"]),
        int(kv_info.get("tensor_parallel_size") or 1),
    )


def read_config(path: Path) -> dict[str, Any]:
    """A model's config.json, given its file or its directory."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LayoutError(f"cannot read a model config from {path}: {exc}") from exc


def tokens_loaded(prompt_tokens: int) -> int:
    """Prompt tokens decode loads from prefill (all of them: no Mamba layers)."""
    return prompt_tokens
