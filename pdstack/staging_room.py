"""The preflight's word on the KV staging buffer: how long a prompt one pull
can send through it (pd_mooncake.staging), against max-model-len.

A pull longer than the whole buffer goes directly, one descriptor per block
and without the late-write protection (pd_mooncake.late_writes), until pulls
cross staging in chunks (not yet). On a large MLA model (Kimi-K2.5: 70 KB a token on
each rank) the reference 256 MiB take a few thousand tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check(result: Any, flags: Mapping[str, Any], kernel: int) -> None:
    """Sets ``result.staged_tokens`` from its regions (a preflight Check);
    a note when max-model-len is longer."""
    from pd_mooncake import staging  # needs torch: the serving image has it

    extra = (flags.get("kv-transfer-config") or {}).get("kv_connector_extra_config")
    if not (capacity := int((extra or {}).get(staging.KEY, 0)) << 20):
        return
    block_bytes = [
        r["bytes_per_block"] for r in result.regions for _ in range(r["layers"])
    ]
    result.staged_tokens = staging.longest_prompt(capacity, block_bytes, kernel)
    longest = int(flags.get("max-model-len") or 0)
    if longest <= result.staged_tokens:
        return
    need = staging.span_bound([-(-longest // kernel)], block_bytes)
    result.notes.append(
        f"the {capacity >> 20} MiB KV staging buffer (`{staging.KEY}`, "
        f"configs/vllm) takes one pull of at most {result.staged_tokens} prompt "
        f"tokens ({sum(block_bytes) // kernel} bytes a token on each rank); a "
        f"longer one (max-model-len {longest}) is sent as one descriptor per "
        "block, without staging's late-write protection (docs/reliability.md). "
        f"{-(-need >> 20)} MiB would take every prompt, in {_home(extra)}"
    )


def _home(extra: Mapping[str, Any]) -> str:
    """Where the plugin puts the buffer (pd_mooncake.device_copy.staging_home)."""
    if extra.get("mooncake_protocol", "rdma") == "tcp":
        return "pinned host memory (mooncake_protocol tcp)"
    return (
        "device memory outside gpu-memory-utilization's (RDMA: lower it by "
        "that many MiB over the GPU's, docs/gpu.md 'KV staging memory')"
    )
