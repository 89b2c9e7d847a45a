"""The names of the series the plugin publishes on the prefill's /metrics.

Apart from ``pd_mooncake.metrics`` (which needs vLLM) so that tools reading
/metrics (pdstack, the bench, the e2e suite) import them without vLLM. These
are the names registered with prometheus_client; a scrape shows a counter as
``<name>_total`` and a histogram as ``<name>_sum``, ``_count`` and ``_bucket``.
"""

from __future__ import annotations

TRANSFERS = "vllm:mooncake_transfers"
BYTES = "vllm:mooncake_bytes_transferred"
DESCRIPTORS = "vllm:mooncake_descriptors"
FAILED_TRANSFERS = "vllm:mooncake_failed_transfers"
RETRIED_TRANSFERS = "vllm:mooncake_retried_transfers"
FAILED_RECVS = "vllm:mooncake_failed_recvs"
EXPIRED = "vllm:mooncake_expired_requests"
# Decode: failed direct pulls whose KV blocks were held back for late writes
# (pd_mooncake.block_hold), and those holds ended.
BLOCK_HOLDS = "vllm:mooncake_block_holds"
BLOCK_HOLDS_ENDED = "vllm:mooncake_block_holds_ended"
# Labels: region (the registered KV tensor), layout (one of the two below).
REGION_BYTES = "vllm:mooncake_region_bytes"
# The values of the layout label: how a registered region lays out its KV
# (pd_mooncake.registration assigns them; pdstack.kv_layout predicts bytes by
# them, without vLLM or torch).
MLA_LAYOUT = "MLA-latent"
GQA_LAYOUT = "GQA K/V"
TRANSFER_TIME = "vllm:mooncake_transfer_time_seconds"
TRANSFER_SIZE = "vllm:mooncake_transfer_size_bytes"
# Labels only: kv_cache_dtype, tensor_parallel_size, fault_switch.
KV_CACHE_INFO = "vllm:mooncake_kv_cache_info"
# The opt-in KV checksum (pd_mooncake.checksum), on decode: one per region of
# each verified request (labels region, layout); a 0/1 gauge where it is on.
CHECKSUM_MISMATCH = "vllm:mooncake_kv_checksum_mismatch"
CHECKSUM_MATCH = "vllm:mooncake_kv_checksum_match"
CHECKSUM_ENABLED = "vllm:mooncake_kv_checksum_enabled"
# Bytes of the KV staging buffer (pd_mooncake.staging) as configured; 0: off.
STAGING_BYTES = "vllm:mooncake_kv_staging_bytes"
# Seconds spent per phase of staged sends (label phase: gather and write on
# prefill, scatter on decode).
STAGING_SECONDS = "vllm:mooncake_kv_staging_seconds"

# (counter, stats key, help): one increment per list item.
COUNTERS = (
    (TRANSFERS, "transfer_duration", "Successful Mooncake KV transfers."),
    (BYTES, "bytes_transferred", "Bytes moved by Mooncake KV transfers."),
    (DESCRIPTORS, "num_descriptors", "Descriptors in Mooncake KV transfers."),
    (FAILED_TRANSFERS, "num_failed_transfers", "Failed Mooncake KV transfers."),
    (
        RETRIED_TRANSFERS,
        "num_retried_transfers",
        "Mooncake KV sends that stalled and had their pending descriptors sent again.",
    ),
    (FAILED_RECVS, "num_failed_recvs", "Failed Mooncake KV receives (decode)."),
    (EXPIRED, "num_kv_expired_reqs", "Requests whose KV expired unsent."),
    (
        BLOCK_HOLDS,
        "num_block_holds",
        "Failed direct pulls whose KV blocks decode held back from reuse while "
        "a late write could land (late_writes).",
    ),
    (
        BLOCK_HOLDS_ENDED,
        "num_block_holds_ended",
        "Block holds ended: their blocks back to reuse (started minus ended: "
        "held now).",
    ),
)
