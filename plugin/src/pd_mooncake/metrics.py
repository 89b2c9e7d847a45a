"""Mooncake transfer statistics as Prometheus metrics on the prefill's /metrics.

Upstream (vLLM 0.32) collects these in ``MooncakeKVConnectorStats`` but only
logs them ("TODO(mooncake-stats): add MooncakePromMetrics"). They travel from
the worker to the API server inside the scheduler stats; this module adds
per-region byte counts to them and turns them into counters and histograms.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import (
    MooncakeKVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

REGION_BYTES = "region_bytes"

# (metric suffix, stats key, help): one increment per list item.
COUNTERS = (
    ("transfers", "transfer_duration", "Successful Mooncake KV transfers."),
    ("bytes_transferred", "bytes_transferred", "Bytes moved by Mooncake KV transfers."),
    ("descriptors", "num_descriptors", "Descriptors in Mooncake KV transfers."),
    ("failed_transfers", "num_failed_transfers", "Failed Mooncake KV transfers."),
    (
        "retried_transfers",
        "num_retried_transfers",
        "Mooncake KV transfers that failed and were sent again.",
    ),
    ("failed_recvs", "num_failed_recvs", "Failed Mooncake KV receives (decode)."),
    ("expired_requests", "num_kv_expired_reqs", "Requests whose KV expired unsent."),
)
RETRIED = dict((suffix, key) for suffix, key, _ in COUNTERS)["retried_transfers"]
TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BYTES_BUCKETS = tuple(float(2**p) for p in range(12, 36, 2))

# The sender thread sets the descriptors of the transfer it is about to
# record, so the stats can attribute bytes to regions under the same lock
# as the transfer itself (a scrape never sees one without the other).
_sending = threading.local()


@dataclass(frozen=True)
class RegionPages:
    """Where one registered region's pages lie: block b's page is
    ``[base + b * stride, base + b * stride + page)``."""

    name: str
    layout: str
    base: int
    stride: int
    page: int
    num_blocks: int


UNREGISTERED = ("unregistered", "unknown")


class RegionMap:
    """Attributes a descriptor's bytes to the regions whose pages it covers.

    Upstream coalesces adjacent blocks, and on block-major layouts one
    descriptor spans the pages of every layer, so a descriptor is split by
    overlap rather than located by its start address.
    """

    def __init__(self, regions: Sequence[RegionPages]) -> None:
        self.regions = list(regions)

    def attribute(self, addr: int, length: int) -> list[tuple[str, str, int]]:
        end = addr + length
        out: list[tuple[str, str, int]] = []
        for r in self.regions:
            if r.stride <= 0 or r.page <= 0:
                continue
            # Blocks whose page can intersect [addr, end).
            first = max(0, (addr - r.base - r.page) // r.stride + 1)
            last = min(r.num_blocks - 1, (end - 1 - r.base) // r.stride)
            covered = 0
            for block in range(first, last + 1):
                start = r.base + block * r.stride
                covered += max(0, min(end, start + r.page) - max(addr, start))
            if covered:
                out.append((r.name, r.layout, covered))
        rest = length - sum(n for _, _, n in out)
        if rest > 0:
            out.append((*UNREGISTERED, rest))
        return out


class PDMooncakeStats(MooncakeKVConnectorStats):
    region_map: RegionMap | None = None

    def reset(self) -> None:
        super().reset()
        self.data[REGION_BYTES] = []
        self.data[RETRIED] = []

    def is_empty(self) -> bool:
        return super().is_empty() and not self.data.get(RETRIED)

    def record_retry(self) -> None:
        """The transfer upstream just counted as failed is being sent again:
        count it as retried; failed counts only transfers that stay failed."""
        with self._lock:
            if self.data["num_failed_transfers"]:
                self.data["num_failed_transfers"].pop()
            self.data[RETRIED].append(1)

    def record_transfer(self, duration_s: float, total_bytes: int, num_descs: int):
        src = getattr(_sending, "descriptors", None)
        with self._lock:
            self.data["transfer_duration"].append(duration_s)
            self.data["bytes_transferred"].append(total_bytes)
            self.data["num_descriptors"].append(num_descs)
            if src is not None and self.region_map is not None:
                for addr, length in zip(*src, strict=True):
                    self.data[REGION_BYTES] += self.region_map.attribute(addr, length)

    def clone_and_reset(self) -> PDMooncakeStats:
        with self._lock:
            snapshot = {k: list(v) for k, v in self.data.items()}
            self.reset()
        return PDMooncakeStats(data=snapshot)

    def aggregate(self, other: Any) -> PDMooncakeStats:
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self


class sending_descriptors:  # noqa: N801 - used as a context manager
    def __init__(self, src_ptrs: list[int], lengths: list[int]) -> None:
        self.value = (src_ptrs, lengths)

    def __enter__(self) -> None:
        _sending.descriptors = self.value

    def __exit__(self, *exc: object) -> None:
        _sending.descriptors = None


class PDMooncakePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:mooncake_{suffix}",
                    documentation=doc,
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for suffix, key, doc in COUNTERS
        }
        self.transfer_time = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:mooncake_transfer_time_seconds",
                documentation="Duration of one Mooncake KV transfer.",
                buckets=TIME_BUCKETS,
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self.transfer_bytes = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:mooncake_transfer_size_bytes",
                documentation="Bytes moved by one Mooncake KV transfer.",
                buckets=BYTES_BUCKETS,
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self.region_bytes = self._counter_cls(
            name="vllm:mooncake_region_bytes",
            documentation="Bytes moved per registered KV region (layer, layout).",
            labelnames=[*labelnames, "region", "layout"],
        )
        self._publish_kv_cache_info(vllm_config, labelnames, per_engine_labelvalues)

    def _publish_kv_cache_info(self, vllm_config, labelnames, per_engine_labelvalues):
        """What a client needs to predict a transfer's bytes and that vLLM's
        ``cache_config_info`` lacks: the KV element type once "auto" is
        resolved to the model's dtype, and the tensor-parallel width (every
        rank sends its own copy of the MLA latent)."""
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype == "auto":
            cache_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        info = self._gauge_cls(
            name="vllm:mooncake_kv_cache_info",
            documentation="KV cache element type and tensor-parallel size.",
            multiprocess_mode="mostrecent",
            labelnames=[*labelnames, "kv_cache_dtype", "tensor_parallel_size"],
        )
        tp = str(vllm_config.parallel_config.tensor_parallel_size)
        for labels in per_engine_labelvalues.values():
            info.labels(*labels, cache_dtype, tp).set(1)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, per_engine in self.counters.items():
            values = transfer_stats_data.get(key, [])
            if key in ("transfer_duration",):
                per_engine[engine_idx].inc(len(values))
            else:
                per_engine[engine_idx].inc(sum(values))
        for seconds in transfer_stats_data.get("transfer_duration", []):
            self.transfer_time[engine_idx].observe(seconds)
        for size in transfer_stats_data.get("bytes_transferred", []):
            self.transfer_bytes[engine_idx].observe(size)
        labels = self.per_engine_labelvalues[engine_idx]
        for name, layout, length in transfer_stats_data.get(REGION_BYTES, []):
            self.region_bytes.labels(*labels, name, layout).inc(length)
