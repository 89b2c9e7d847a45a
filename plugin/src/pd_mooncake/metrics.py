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

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from pd_mooncake import checksum, faults, staging
from pd_mooncake import metric_names as names
from pd_mooncake.metric_names import COUNTERS

try:  # vLLM >= 0.20 has a Mooncake stats container (detected by the module)
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import (
        MooncakeKVConnectorStats,
    )
except ModuleNotFoundError:  # 0.19.x: none; the same interface, ours
    from pd_mooncake.legacy_stats import MooncakeKVConnectorStats

REGION_BYTES = "region_bytes"
# Stats key: (phase, seconds) of staged sends (pd_mooncake.staging).
STAGING_SECONDS = "staging_seconds"

_KEYS = {name: key for name, key, _ in COUNTERS}
RETRIED = _KEYS[names.RETRIED_TRANSFERS]
BLOCK_HOLDS = _KEYS[names.BLOCK_HOLDS]
BLOCK_HOLDS_ENDED = _KEYS[names.BLOCK_HOLDS_ENDED]
# The counters upstream's stats lack (ours alone, on every release).
OWN_COUNTERS = (RETRIED, BLOCK_HOLDS, BLOCK_HOLDS_ENDED)
# Where upstream publishes its own Mooncake metrics (vLLM 0.33,
# ``MooncakePromMetrics``), the plugin publishes none of its copies: each of
# these stats keys is then upstream's series (right), not ours (left).
UPSTREAM_SERIES = {
    "transfer_duration": (
        "vllm:mooncake_transfers_total, vllm:mooncake_transfer_time_seconds",
        "vllm:mooncake_xfer_time_seconds (_count: transfers)",
    ),
    "bytes_transferred": (
        "vllm:mooncake_bytes_transferred_total, vllm:mooncake_transfer_size_bytes",
        "vllm:mooncake_bytes_transferred (histogram; _sum: bytes)",
    ),
    "num_descriptors": (
        "vllm:mooncake_descriptors_total",
        "vllm:mooncake_num_descriptors (histogram; _sum: descriptors)",
    ),
    "num_failed_transfers": (
        "vllm:mooncake_failed_transfers_total",
        "vllm:mooncake_num_failed_transfers_total",
    ),
    "num_failed_recvs": (
        "vllm:mooncake_failed_recvs_total",
        "vllm:mooncake_num_failed_recvs_total",
    ),
    "num_kv_expired_reqs": (
        "vllm:mooncake_expired_requests_total",
        "vllm:mooncake_num_kv_expired_reqs_total",
    ),
}
TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BYTES_BUCKETS = tuple(float(2**p) for p in range(12, 36, 2))

# The sender thread's current send (``sending_descriptors``): its
# descriptors, so the stats attribute bytes to regions under the same lock as
# the transfer itself (a scrape never sees one without the other).
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
    """Attributes a send's bytes to the regions whose pages its descriptors
    cover.

    Upstream coalesces adjacent blocks, and on block-major layouts one
    descriptor spans the pages of every layer, so a descriptor is split by
    overlap rather than located by its start address: per region, the bytes
    of its pages below the descriptor's end less those below its start
    (``_below``, a closed form), for all of a send's descriptors at once. A
    fragmented 152 MiB send on the twin (4,608 descriptors, 9 regions) took
    the sender thread 13 ms one descriptor at a time, 1.5 ms so
    (2026-12-03).
    """

    def __init__(self, regions: Sequence[RegionPages]) -> None:
        self.regions = list(regions)
        self._usable = [r for r in self.regions if r.stride > 0 and r.page > 0]

    def attribute(self, addr: int, length: int) -> list[tuple[str, str, int]]:
        return self.totals([addr], [length])

    def totals(
        self, addrs: Sequence[int], lengths: Sequence[int]
    ) -> list[tuple[str, str, int]]:
        """The bytes of a send's descriptors per region, in registration
        order, and any outside every region as ``UNREGISTERED``: the stats
        carry a send's few entries, not one per descriptor."""
        start = np.asarray(addrs, dtype=np.int64)
        length = np.asarray(lengths, dtype=np.int64)
        if start.shape != length.shape:
            raise ValueError("RegionMap.totals: addresses and lengths differ in count")
        end = start + length
        rest = length.copy()
        summed: dict[tuple[str, str], int] = {}
        for r in self._usable:
            covered = _below(r, end) - _below(r, start)
            rest -= covered
            if n := int(covered.sum()):
                summed[r.name, r.layout] = summed.get((r.name, r.layout), 0) + n
        out = [(name, layout, n) for (name, layout), n in summed.items()]
        if (outside := int(np.maximum(rest, 0).sum())) > 0:
            out.append((*UNREGISTERED, outside))
        return out


def _below(r: RegionPages, x: np.ndarray) -> np.ndarray:
    """Bytes of ``r``'s pages below each address in ``x``. Blocks ``b <
    whole`` lie wholly below; each later block up to ``last`` (the last to
    start below) contributes ``y - b * stride``: an arithmetic series, so
    pages longer than their stride (overlapping) cost no more."""
    y = x - r.base
    whole = np.clip((y - r.page) // r.stride + 1, 0, r.num_blocks)
    last = np.minimum(r.num_blocks - 1, (y - 1) // r.stride)
    k = np.maximum(last - whole + 1, 0)
    partial = k * y - r.stride * ((whole + last) * k // 2)
    return np.where(y > 0, whole * r.page + partial, 0)


class PDMooncakeStats(MooncakeKVConnectorStats):
    region_map: RegionMap | None = None

    def reset(self) -> None:
        super().reset()
        self.data[REGION_BYTES] = []
        for key in OWN_COUNTERS:
            self.data[key] = []
        self.data[STAGING_SECONDS] = []

    def is_empty(self) -> bool:
        return super().is_empty() and not any(
            self.data.get(k)
            for k in (*OWN_COUNTERS, STAGING_SECONDS, *checksum.STATS_KEYS)
        )

    def record_checksum(self, region: str, layout: str, ok: bool) -> None:
        """Decode verified one region of a request (checksum.py)."""
        key = checksum.MATCH_KEY if ok else checksum.MISMATCH_KEY
        with self._lock:
            self.data.setdefault(key, []).append((region, layout))

    def record_staging(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.data.setdefault(STAGING_SECONDS, []).append((phase, seconds))

    def record_retry(self) -> None:
        """A stalled send's pending descriptors are sent again: retried, not
        failed (failed counts transfers that stay failed; a send records its
        failure only once it has given up, connector._send_blocks)."""
        with self._lock:
            self.data[RETRIED].append(1)

    def record_block_holds(self, started: int = 0, ended: int = 0) -> None:
        """Decode held failed direct pulls' blocks back, or gave them back
        (block_hold)."""
        with self._lock:
            if started:
                self.data[BLOCK_HOLDS].append(started)
            if ended:
                self.data[BLOCK_HOLDS_ENDED].append(ended)

    def record_transfer(self, duration_s: float, total_bytes: int, num_descs: int):
        src = getattr(_sending, "current", None)
        regions = []
        if src is not None and self.region_map is not None:
            # Before the lock, appended under it with the transfer: a scrape
            # still never sees one without the other.
            regions = self.region_map.totals(*src)
        with self._lock:
            self.data["transfer_duration"].append(duration_s)
            self.data["bytes_transferred"].append(total_bytes)
            self.data["num_descriptors"].append(num_descs)
            self.data[REGION_BYTES] += regions

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
    """One send, in the sending thread (``_send_blocks``)."""

    def __init__(self, src_ptrs: list[int], lengths: list[int]) -> None:
        self.value = (src_ptrs, lengths)

    def __enter__(self) -> None:
        _sending.current = self.value

    def __exit__(self, *exc: object) -> None:
        _sending.current = None


class PDMooncakePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from pd_mooncake import fixes

        # Detected by feature: upstream's own metrics, if it has them, own
        # every series they cover; ours add only what upstream lacks.
        upstream_cls = fixes.upstream_prom_metrics()
        self.upstream = (
            None
            if upstream_cls is None
            else upstream_cls(
                vllm_config, metric_types, labelnames, per_engine_labelvalues
            )
        )
        covered = set() if self.upstream is None else set(UPSTREAM_SERIES)
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(
                    name=name,
                    documentation=doc,
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for name, key, doc in COUNTERS
            if key not in covered
        }
        self.transfer_time = self.transfer_bytes = None
        if self.upstream is None:
            self._own_histograms(labelnames, per_engine_labelvalues)
        self.staging_seconds = self._counter_cls(
            name=names.STAGING_SECONDS,
            documentation="Seconds per phase of staged KV sends (gather, write, "
            "scatter).",
            labelnames=[*labelnames, "phase"],
        )
        self.region_bytes = self._counter_cls(
            name=names.REGION_BYTES,
            documentation="Bytes moved per registered KV region (layer, layout).",
            labelnames=[*labelnames, "region", "layout"],
        )
        self._publish_kv_cache_info(vllm_config, labelnames, per_engine_labelvalues)
        self._checksum_metrics(vllm_config, labelnames, per_engine_labelvalues)

    def _checksum_metrics(self, vllm_config, labelnames, per_engine_labelvalues):
        """Decode's verdicts per region (checksum.py); 1 where it is on."""
        self.checksum_counts = {
            key: self._counter_cls(
                name=name,
                documentation=doc,
                labelnames=[*labelnames, "region", "layout"],
            )
            for key, name, doc in (
                (checksum.MATCH_KEY, checksum.MATCH, "KV regions verified intact."),
                (checksum.MISMATCH_KEY, checksum.MISMATCH, "KV regions that differ."),
            )
        }
        kv = getattr(vllm_config, "kv_transfer_config", None)
        extra = getattr(kv, "kv_connector_extra_config", None) or {}
        enabled = self._gauge_cls(
            name=checksum.ENABLED,
            documentation="1 where the opt-in KV checksum is on (kv_checksum).",
            multiprocess_mode="mostrecent",
            labelnames=labelnames,
        )
        staging_bytes = self._gauge_cls(
            name=names.STAGING_BYTES,
            documentation="Bytes of the KV staging buffer (kv_staging_mib); 0: off.",
            multiprocess_mode="mostrecent",
            labelnames=labelnames,
        )
        for labels in per_engine_labelvalues.values():
            enabled.labels(*labels).set(int(bool(extra.get(checksum.KEY))))
            staging_bytes.labels(*labels).set(int(extra.get(staging.KEY, 0)) << 20)

    def _own_histograms(self, labelnames, per_engine_labelvalues) -> None:
        for attr, name, documentation, buckets in (
            ("transfer_time", names.TRANSFER_TIME,
             "Duration of one Mooncake KV transfer.", TIME_BUCKETS),
            ("transfer_bytes", names.TRANSFER_SIZE,
             "Bytes moved by one Mooncake KV transfer.", BYTES_BUCKETS),
        ):  # fmt: skip
            histogram = self._histogram_cls(
                name=name,
                documentation=documentation,
                buckets=buckets,
                labelnames=labelnames,
            )
            setattr(
                self, attr, create_metric_per_engine(histogram, per_engine_labelvalues)
            )

    def _publish_kv_cache_info(self, vllm_config, labelnames, per_engine_labelvalues):
        """What a client needs to predict a transfer's bytes and that vLLM's
        ``cache_config_info`` lacks: the KV element type once "auto" is
        resolved to the model's dtype, the tensor-parallel width (every rank
        sends its own copy of the MLA latent), and which test-only fault
        switch the server was started with (a dashboard can alert on one in
        production; the e2e suite skips its negative controls without one)."""
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype == "auto":
            cache_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        info = self._gauge_cls(
            name=names.KV_CACHE_INFO,
            documentation="KV cache element type and tensor-parallel size.",
            multiprocess_mode="mostrecent",
            labelnames=[
                *labelnames,
                "kv_cache_dtype",
                "tensor_parallel_size",
                "fault_switch",
            ],
        )
        tp = str(vllm_config.parallel_config.tensor_parallel_size)
        switch = faults.configured_switch()
        for labels in per_engine_labelvalues.values():
            info.labels(*labels, cache_dtype, tp, switch).set(1)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, per_engine in self.counters.items():
            values = transfer_stats_data.get(key, [])
            if key in ("transfer_duration",):
                per_engine[engine_idx].inc(len(values))
            else:
                per_engine[engine_idx].inc(sum(values))
        if self.upstream is not None:
            self.upstream.observe(transfer_stats_data, engine_idx)
        if self.transfer_time is not None and self.transfer_bytes is not None:
            for seconds in transfer_stats_data.get("transfer_duration", []):
                self.transfer_time[engine_idx].observe(seconds)
            for size in transfer_stats_data.get("bytes_transferred", []):
                self.transfer_bytes[engine_idx].observe(size)
        labels = self.per_engine_labelvalues[engine_idx]
        for name, layout, length in transfer_stats_data.get(REGION_BYTES, []):
            self.region_bytes.labels(*labels, name, layout).inc(length)
        for phase, seconds in transfer_stats_data.get(STAGING_SECONDS, []):
            self.staging_seconds.labels(*labels, phase).inc(seconds)
        for key, counter in self.checksum_counts.items():
            for name, layout in transfer_stats_data.get(key, []):
                counter.labels(*labels, name, layout).inc()
