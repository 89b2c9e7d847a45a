"""The Mooncake stats container for vLLM releases that have none (0.19.x).

vLLM 0.20 added ``mooncake/stats.py`` (``MooncakeKVConnectorStats``); before
it the Mooncake worker records no statistics at all. The plugin's stats
(metrics.PDMooncakeStats) subclass upstream's container, so on such a release
they subclass this one: the same keys and methods, on vLLM's generic
``KVConnectorStats``. Upstream 0.19 never records a transfer, so there only
the plugin's own records (retries, checksums, region bytes) can appear.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

KEYS = (
    "transfer_duration",
    "bytes_transferred",
    "num_descriptors",
    "num_failed_transfers",
    "num_failed_recvs",
    "num_kv_expired_reqs",
)


@dataclass
class MooncakeKVConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        if not self.data:
            self.reset()

    # Stats travel from the worker to the API server: the lock stays behind.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def reset(self) -> None:
        self.data = {key: [] for key in KEYS}

    def record_transfer(self, duration_s: float, total_bytes: int, num_descs: int):
        with self._lock:
            self.data["transfer_duration"].append(duration_s)
            self.data["bytes_transferred"].append(total_bytes)
            self.data["num_descriptors"].append(num_descs)

    def record_failed_transfer(self) -> None:
        with self._lock:
            self.data["num_failed_transfers"].append(1)

    def record_failed_recv(self) -> None:
        with self._lock:
            self.data["num_failed_recvs"].append(1)

    def record_kv_expired_req(self) -> None:
        with self._lock:
            self.data["num_kv_expired_reqs"].append(1)

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {
            "Num successful transfers": len(self.data["transfer_duration"]),
            "Num failed transfers": len(self.data["num_failed_transfers"]),
            "Num failed recvs": len(self.data["num_failed_recvs"]),
            "Num KV expired reqs": len(self.data["num_kv_expired_reqs"]),
        }
