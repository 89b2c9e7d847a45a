"""The preflight's word on the KV staging buffer: how long a prompt one pull
can send through it (pd_mooncake.staging), against max-model-len.

A pull longer than the whole buffer goes directly, one descriptor per block
and without the late-write protection (pd_mooncake.late_writes), until pulls
cross staging in chunks (issue 26). On a large MLA model (Kimi-K2.5: 70 KB a token on
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
        f"longer one (max-model-len {longest}) fails with the reason, never sent "
        "directly (docs/reliability.md). "
        f"{-(-need >> 20)} MiB would take every prompt, in device memory beside "
        f"gpu-memory-utilization's; `{staging.KEY}: 0` sends every pull directly"
    )
