"""The preflight's word on the KV staging buffer: how many prompt tokens one
chunk of a pull carries through it (pd_mooncake.staging), and so how many
chunks a prompt of max-model-len crosses in.

Every pull is staged whatever its length: a request longer than one span
crosses in chunks, one span at a time (pd_mooncake.pull). A larger buffer
means fewer chunks (each is one round trip on the side channel), not
longer prompts. On a large MLA model (Kimi-K2.5: 70 KB a token on each
rank) the reference 256 MiB carry a few thousand tokens a chunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check(result: Any, flags: Mapping[str, Any], kernel: int) -> None:
    """Sets ``result.chunk_tokens`` from its regions (a preflight Check);
    a problem when the buffer cannot hold one block (every pull would fail)."""
    from pd_mooncake import staging  # needs torch: the serving image has it

    extra = (flags.get("kv-transfer-config") or {}).get("kv_connector_extra_config")
    if not (capacity := int((extra or {}).get(staging.KEY, 0)) << 20):
        return
    block_bytes = [
        r["bytes_per_block"] for r in result.regions for _ in range(r["layers"])
    ]
    result.chunk_tokens = staging.chunk_blocks(capacity, block_bytes) * kernel
    if device_memory(extra or {}):
        result.notes.append(
            f"the {capacity >> 20} MiB KV staging buffer (`{staging.KEY}`) is "
            "device memory outside gpu-memory-utilization's (mooncake_protocol "
            f"rdma): lower that by {capacity >> 20} MiB over the GPU's memory "
            "(docs/gpu.md, 'KV staging memory')"
        )
    if not result.chunk_tokens:
        need = staging.span_bound([1], block_bytes)
        result.problems.append(
            f"the {capacity >> 20} MiB KV staging buffer (`{staging.KEY}`, "
            f"configs/vllm) holds no whole KV block ({need} bytes on each "
            "rank): every pull would fail; raise it, or set it to 0"
        )


def device_memory(extra: Mapping[str, Any]) -> bool:
    """Whether the plugin puts the staging buffer in the GPU's memory
    (pd_mooncake.device_copy.staging_home: over RDMA; over TCP it is pinned
    host memory). Upstream's default protocol is rdma."""
    return extra.get("mooncake_protocol", "rdma") != "tcp"
