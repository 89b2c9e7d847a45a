"""Transfer statistics exported as Prometheus metrics."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pd_mooncake import metrics


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


def exported(data: dict) -> dict[str, float]:
    registry = CollectorRegistry()
    prom = metrics.PDMooncakePromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        RegisteredIn(registry).types,
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    prom.observe(data, 0)
    values = {}
    for family in registry.collect():
        for sample in family.samples:
            key = sample.name + (
                f"{{{sample.labels['region']}}}" if "region" in sample.labels else ""
            )
            values[key] = sample.value
    assert generate_latest(registry)
    return values


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
    snapshot = recorded_stats().clone_and_reset()
    assert snapshot.data[metrics.REGION_BYTES] == [
        ("mla.0", "MLA-latent", 100),
        ("mla.0", "MLA-latent", 100),
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
