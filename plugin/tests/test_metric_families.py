"""The plugin's Prometheus families on the installed vLLM (and, in
``make test-compat``, on 0.33.0's source): none served twice, the plugin's
own ones always there. On a release that exports Mooncake transfer metrics
itself (0.33.0: ``vllm:mooncake_xfer_time_seconds`` and others) the plugin
publishes no copy of them: a second registration of a family in one registry
raises, and the exposition would repeat it."""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import prom_metrics, recorded_stats

from pd_mooncake import fixes, metric_names

PLUGIN_ONLY = (
    metric_names.REGION_BYTES,
    metric_names.RETRIED_TRANSFERS,
    metric_names.BLOCK_HOLDS,
    metric_names.BLOCK_HOLDS_ENDED,
    metric_names.CHECKSUM_MATCH,
    metric_names.CHECKSUM_MISMATCH,
    metric_names.KV_CACHE_INFO,
)


def served_families() -> list[str]:
    registry = CollectorRegistry()
    prom_metrics(registry).observe(recorded_stats().clone_and_reset().data, 0)
    text = generate_latest(registry).decode()
    return [family.name for family in text_string_to_metric_families(text)]


def test_no_family_is_served_twice_and_the_plugins_own_are_there() -> None:
    names = served_families()
    twice = [name for name, n in collections.Counter(names).items() if n > 1]
    assert not twice, twice
    for name in PLUGIN_ONLY:
        assert name.removesuffix("_total") in names, (name, sorted(names))


def test_transfer_time_is_served_once_by_whoever_owns_it() -> None:
    """0.32: the plugin's histogram; a release with its own (0.33): upstream's,
    and not the plugin's beside it."""
    names = served_families()
    upstream = fixes.upstream_prom_metrics()
    if upstream is None:
        assert metric_names.TRANSFER_TIME in names
    else:
        assert metric_names.TRANSFER_TIME not in names
        assert "vllm:mooncake_xfer_time_seconds" in names
