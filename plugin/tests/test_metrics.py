"""Transfer statistics exported as Prometheus metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import zmq.asyncio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families
from scripted_engine import ScriptedEngine
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from conftest import STALL_S
from pd_mooncake import connector, metrics


class RegisteredIn:
    """Metric classes bound to a private registry (vLLM passes its own)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.types = {
            kind: type(kind.__name__, (kind,), {"__init__": _bind(kind, registry)})
            for kind in (Counter, Gauge, Histogram)
        }


def _bind(kind, registry):
    def __init__(self, *args, **kwargs):  # noqa: N807
        kind.__init__(self, *args, registry=registry, **kwargs)

    return __init__


def prom_metrics(registry: CollectorRegistry) -> metrics.PDMooncakePromMetrics:
    """The plugin's Prometheus metrics for one engine, registered in
    ``registry``, with the config fields they read."""
    return metrics.PDMooncakePromMetrics(
        SimpleNamespace(
            kv_transfer_config=None,
            cache_config=SimpleNamespace(cache_dtype="auto"),
            model_config=SimpleNamespace(dtype="torch.float32"),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
        ),
        RegisteredIn(registry).types,
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )


def exported(data: dict) -> dict[str, float]:
    registry = CollectorRegistry()
    prom = prom_metrics(registry)
    prom.observe(data, 0)
    # Read back from the exposition text /metrics serves (what Prometheus and
    # the e2e suite parse), not from the registry's objects.
    served = list(text_string_to_metric_families(generate_latest(registry).decode()))
    values = {}
    for family in served:
        for sample in family.samples:
            key = sample.name + (
                f"{{{sample.labels['region']}}}" if "region" in sample.labels else ""
            )
            values[key] = sample.value
    # Every sample the registry holds is served, with its labels and value.
    assert samples(served) == samples(registry.collect())
    return values


def samples(families: Any) -> dict[tuple[str, frozenset], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in families
        for sample in family.samples
    }


def recorded_stats() -> metrics.PDMooncakeStats:
    stats = metrics.PDMooncakeStats()
    stats.region_map = metrics.RegionMap(
        [
            metrics.RegionPages("mla.0", "MLA-latent", 1000, 500, 100, 2),
            metrics.RegionPages("draft", "GQA K/V", 5000, 400, 400, 10),
        ]
    )
    with metrics.sending_descriptors([1000, 1500, 5000], [100, 100, 400]):
        stats.record_transfer(0.002, 600, 3)
    stats.record_failed_recv()
    return stats


def test_region_bytes_are_attributed_with_the_transfer() -> None:
    """One entry per region a send touched (its two MLA descriptors summed),
    not one per descriptor: the stats a step carries stay small."""
    snapshot = recorded_stats().clone_and_reset()
    assert snapshot.data[metrics.REGION_BYTES] == [
        ("mla.0", "MLA-latent", 200),
        ("draft", "GQA K/V", 400),
    ]


def test_counters_and_histograms() -> None:
    values = exported(recorded_stats().clone_and_reset().data)
    assert values["vllm:mooncake_transfers_total"] == 1
    assert values["vllm:mooncake_bytes_transferred_total"] == 600
    assert values["vllm:mooncake_descriptors_total"] == 3
    assert values["vllm:mooncake_failed_recvs_total"] == 1
    assert values["vllm:mooncake_failed_transfers_total"] == 0
    assert values["vllm:mooncake_transfer_time_seconds_count"] == 1
    assert values["vllm:mooncake_region_bytes_total{mla.0}"] == 200
    assert values["vllm:mooncake_region_bytes_total{draft}"] == 400


def test_stats_survive_aggregation_across_steps() -> None:
    """Every transfer counts, however the engine batches its stats."""
    total = metrics.PDMooncakeStats()
    for _ in range(29):
        total.aggregate(recorded_stats().clone_and_reset())
    values = exported(total.data)
    assert values["vllm:mooncake_transfers_total"] == 29
    assert values["vllm:mooncake_region_bytes_total{draft}"] == 29 * 400


def test_address_outside_any_region_is_reported_not_hidden() -> None:
    region_map = metrics.RegionMap(
        [metrics.RegionPages("a", "MLA-latent", 0, 10, 10, 1)]
    )
    assert region_map.attribute(10, 5) == [("unregistered", "unknown", 5)]


def test_a_coalesced_descriptor_is_split_across_interleaved_layers() -> None:
    """Block-major layout: each 300-byte block holds layer a (100 bytes), layer
    b (100 bytes) and 100 bytes of padding; a descriptor of two whole blocks
    counts 200 bytes for each layer and the padding as unregistered."""
    region_map = metrics.RegionMap(
        [
            metrics.RegionPages("a", "MLA-latent", 0, 300, 100, 4),
            metrics.RegionPages("b", "GQA K/V", 100, 300, 100, 4),
        ]
    )
    assert region_map.attribute(300, 600) == [
        ("a", "MLA-latent", 200),
        ("b", "GQA K/V", 200),
        ("unregistered", "unknown", 200),
    ]


def block_by_block(
    regions: list[metrics.RegionPages], addr: int, length: int
) -> list[tuple[str, str, int]]:
    """The attribution page by page, every region: what RegionMap computes."""
    end, out = addr + length, []
    for r in regions:
        starts = [r.base + b * r.stride for b in range(r.num_blocks)]
        covered = sum(max(0, min(end, a + r.page) - max(addr, a)) for a in starts)
        if r.stride <= 0 or r.page <= 0:
            covered = 0
        if covered:
            out.append((r.name, r.layout, covered))
    if (rest := length - sum(n for _, _, n in out)) > 0:
        out.append((*metrics.UNREGISTERED, rest))
    return out


@pytest.mark.parametrize("layout", ["layer-major", "block-major", "overlapping"])
def test_attribution_matches_page_by_page(layout: str) -> None:
    """Layer-major regions (the twin's: apart, found by bisection),
    interleaved block-major ones and pages longer than their stride, against
    the page-by-page sum, for random descriptors in and around them."""
    rng = random.Random(layout)
    if layout == "layer-major":
        # Registered out of address order.
        regions = [metrics.RegionPages(f"l{i}", "MLA", 1000 + i * 4000, 96, 64, 40)
                   for i in (3, 0, 2, 1)]  # fmt: skip
    elif layout == "block-major":
        regions = [metrics.RegionPages(f"l{i}", "GQA K/V", 1000 + i * 100, 300, 100, 50)
                   for i in range(3)]  # fmt: skip
    else:
        regions = [metrics.RegionPages("o", "MLA-latent", 1000, 50, 80, 60)]
    region_map = metrics.RegionMap(regions)
    for _ in range(2000):
        addr = rng.randrange(0, 18000)
        length = rng.randrange(1, 3000)
        assert region_map.attribute(addr, length) == block_by_block(
            regions, addr, length
        ), (addr, length)


@pytest.mark.parametrize("layout", ["layer-major", "block-major", "overlapping"])
def test_a_sends_totals_are_its_descriptors_page_by_page(layout: str) -> None:
    """``totals`` takes a send's descriptors at once: per region the sum of
    each descriptor's page-by-page attribution, the bytes outside every
    region summed likewise."""
    rng = random.Random(f"totals {layout}")
    regions = {
        "layer-major": [metrics.RegionPages(f"l{i}", "MLA", 1000 + i * 4000, 96, 64, 40)
                        for i in (3, 0, 2, 1)],
        "block-major": [metrics.RegionPages(f"l{i}", "GQA K/V", 1000 + i * 100, 300,
                                            100, 50) for i in range(3)],
        "overlapping": [metrics.RegionPages("o", "MLA-latent", 1000, 50, 80, 60)],
    }[layout]  # fmt: skip
    region_map = metrics.RegionMap(regions)
    for _ in range(50):
        sends = [(rng.randrange(0, 18000), rng.randrange(1, 3000)) for _ in range(40)]
        expected: dict[tuple[str, str], int] = {}
        for addr, length in sends:
            for name, kind, n in block_by_block(regions, addr, length):
                expected[name, kind] = expected.get((name, kind), 0) + n
        got = region_map.totals([a for a, _ in sends], [n for _, n in sends])
        assert {(name, kind): n for name, kind, n in got} == expected


# --- resent stalls and the failure record ---------------------------------------
# A Mooncake TCP stall (both peers stop reading their sockets until the next
# submission, kvcache-ai/Mooncake#4209 family) cannot be produced on
# demand between two real engines, so the engine is scripted; the worker's
# _send_blocks, stall_guard, the stats and the scrape are the real ones.

UPSTREAM_LOGGER = (
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"
)
PLUGIN_LOGGER = "vllm.pd_mooncake"


class OnLine(logging.Handler):
    """Runs ``action`` in the sending thread when a log line starts with
    ``prefix``: the plugin's stall line comes right before the resend, i.e.
    between a send's two rounds."""

    def __init__(self, prefix: str, action: Callable[[], None]) -> None:
        super().__init__(logging.WARNING)
        self.prefix, self.action = prefix, action

    def handle(self, record: logging.LogRecord) -> bool:
        # Without the handler's lock: the action lets another sender log.
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(self.prefix):
            self.action()


@contextlib.contextmanager
def on_line(logger: str, prefix: str, action: Callable[[], None]) -> Iterator[None]:
    handler = OnLine(prefix, action)
    logging.getLogger(logger).addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger(logger).removeHandler(handler)


class ScriptedSessions:
    """A ScriptedEngine per remote session, batch ids kept apart."""

    def __init__(self, scripts: dict[str, list[tuple[int, float]]]) -> None:
        self.engines = {name: ScriptedEngine(steps) for name, steps in scripts.items()}
        self.ids: dict[int, tuple[ScriptedEngine, int]] = {}
        self.lock = threading.Lock()

    def transfer_submit_write(self, session: str, *args: int) -> int:
        engine = self.engines[session]
        inner = engine.transfer_submit_write(session, *args)
        with self.lock:
            batch_id = len(self.ids) + 1
            self.ids[batch_id] = (engine, inner)
        return batch_id

    def transfer_check_status(self, batch_id: int) -> int:
        engine, inner = self.ids[batch_id]
        return engine.transfer_check_status(inner)

    def batch_transfer_sync_write(self, session: str, *args: Any) -> int:
        return self.engines[session].batch_transfer_sync_write(*args)


def on_stall(session: str, action: Callable[[], None]) -> Any:
    return on_line(PLUGIN_LOGGER, f"PD Mooncake: send to {session} stalled", action)


def sender(scripts: dict[str, list[tuple[int, float]]]) -> Any:
    worker = object.__new__(connector.PDMooncakeConnectorWorker)
    worker.engine = ScriptedSessions(scripts)
    worker.xfer_stats = metrics.PDMooncakeStats()
    worker.stall_s = STALL_S
    # What shutdown() (run by __del__) touches.
    worker.async_zmq_ctx = zmq.asyncio.Context()
    worker.receiver_loop = asyncio.new_event_loop()
    return worker


def send(worker: Any, session: str) -> int:
    return worker._send_blocks(session, [4096], [0], [4096])


def scrape(worker: Any, scrapes: list[dict]) -> None:
    """What the engine's step does: upstream's get_kv_connector_stats."""
    stats = worker.get_kv_connector_stats()
    scrapes.append({} if stats is None else {k: list(v) for k, v in stats.data.items()})


def totals(scrapes: list[dict]) -> dict[str, int]:
    return {
        key: sum(len(s.get(key, [])) for s in scrapes)
        for key in ("transfer_duration", "num_failed_transfers", metrics.RETRIED)
    }


def scrape_only(worker: Any, scrapes: list[dict]) -> None:
    scrape(worker, scrapes)


def b_fails_then_scrape(worker: Any, scrapes: list[dict]) -> None:
    """Sender b fails for good, then the scrape."""
    other = threading.Thread(target=send, args=(worker, "b"))
    other.start()
    other.join(timeout=10)
    scrape(worker, scrapes)


@pytest.mark.usefixtures("short_stalls")
@pytest.mark.parametrize(
    ("scripts", "between", "failed"),
    [
        pytest.param({"a": [(-1, STALL_S), (0, 0.0)]}, scrape_only, 0, id="a alone"),
        pytest.param(
            {"a": [(-1, STALL_S), (0, 0.0)], "b": [(-1, 0.0)]},
            b_fails_then_scrape,
            1,
            id="b fails meanwhile",
        ),
    ],
)
def test_a_scrape_between_attempts_sees_only_final_failures(
    scripts: dict[str, list[tuple[int, float]]],
    between: Callable[[Any, list[dict]], None],
    failed: int,
) -> None:
    """Sender a's first attempt stalls, its retry succeeds; a scrape between
    the two never sees a's retried attempt fail. Concurrent senders keep their
    own outcome: when sender b fails for good meanwhile, that scrape shows b's
    failure, and only b's."""
    worker = sender(scripts)
    scrapes: list[dict] = []
    with on_stall("a", lambda: between(worker, scrapes)):
        assert send(worker, "a") == 0
    scrape(worker, scrapes)
    assert scrapes[0].get("num_failed_transfers", []) == [1] * failed
    assert totals(scrapes) == {
        "transfer_duration": 1,
        "num_failed_transfers": failed,
        metrics.RETRIED: 1,
    }


@pytest.mark.usefixtures("short_stalls")
def test_negative_control_the_scrape_catches_a_stalled_attempts_failure() -> None:
    """The detector: upstream's send records a stalled attempt as failed, and
    a scrape right after it (before any retry could take it back) sees it."""
    worker = sender({"a": [(-1, STALL_S)]})
    scrapes: list[dict] = []
    with on_line(
        UPSTREAM_LOGGER, "Sending to a failed", lambda: scrape(worker, scrapes)
    ):
        assert (
            upstream.MooncakeConnectorWorker._send_blocks(
                worker, "a", [4096], [0], [4096]
            )
            == -1
        )
    assert scrapes[0]["num_failed_transfers"] == [1]
