"""Reading Prometheus /metrics: the evidence that KV crossed from prefill to decode."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import requests
from prometheus_client.parser import text_string_to_metric_families

from pd_mooncake import metric_names as plugin
from pdstack import wait

# Decode: prompt tokens loaded from prefill rather than computed.
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
# Decode: speculative decoding.
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
# Prefill: this plugin's Mooncake transfer metrics, as a scrape shows them.
TRANSFERS = f"{plugin.TRANSFERS}_total"
BYTES = f"{plugin.BYTES}_total"
DESCRIPTORS = f"{plugin.DESCRIPTORS}_total"
FAILED_TRANSFERS = f"{plugin.FAILED_TRANSFERS}_total"
RETRIED_TRANSFERS = f"{plugin.RETRIED_TRANSFERS}_total"
FAILED_RECVS = f"{plugin.FAILED_RECVS}_total"
EXPIRED = f"{plugin.EXPIRED}_total"
REGION_BYTES = f"{plugin.REGION_BYTES}_total"
TRANSFER_SECONDS = f"{plugin.TRANSFER_TIME}_sum"
KV_USAGE = "vllm:kv_cache_usage_perc"
# Info gauges (labels only): vLLM's cache configuration, and the plugin's
# KV element type, tensor-parallel width and fault switch.
CACHE_CONFIG_INFO = "vllm:cache_config_info"
KV_CACHE_INFO = plugin.KV_CACHE_INFO
CHECKSUM_MISMATCH = f"{plugin.CHECKSUM_MISMATCH}_total"
CHECKSUM_MATCH = f"{plugin.CHECKSUM_MATCH}_total"
CHECKSUM_ENABLED = plugin.CHECKSUM_ENABLED
STAGING_BYTES = plugin.STAGING_BYTES
STAGING_SECONDS = f"{plugin.STAGING_SECONDS}_total"
RUNNING = "vllm:num_requests_running"

Labels = frozenset[tuple[str, str]]


@dataclass(frozen=True)
class Snapshot:
    samples: Mapping[tuple[str, Labels], float]

    def total(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples whose labels include ``labels``."""
        want = set(labels.items())
        return sum(
            value
            for (sample, have), value in self.samples.items()
            if sample == name and want <= have
        )

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (sample, have), value in self.samples.items():
            if sample == name:
                key = dict(have).get(label, "")
                out[key] = out.get(key, 0.0) + value
        return out

    def labels_of(self, name: str) -> dict[str, str]:
        """The labels of the first sample of ``name`` (for *_info gauges)."""
        return next((dict(have) for sample, have in self.samples if sample == name), {})

    def __sub__(self, before: Snapshot) -> Snapshot:
        keys = set(self.samples) | set(before.samples)
        return Snapshot(
            {k: self.samples.get(k, 0.0) - before.samples.get(k, 0.0) for k in keys}
        )

    def __add__(self, other: Snapshot) -> Snapshot:
        """Two servers' samples summed: counters (and their deltas) of a
        role's servers add up; info gauges do not (read those per server)."""
        keys = set(self.samples) | set(other.samples)
        return Snapshot(
            {k: self.samples.get(k, 0.0) + other.samples.get(k, 0.0) for k in keys}
        )


def scrape(base_url: str, timeout: float = 10.0) -> Snapshot:
    response = requests.get(f"{base_url}/metrics", timeout=timeout)
    response.raise_for_status()
    samples: dict[tuple[str, Labels], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return Snapshot(samples)


def scrape_sum(base_urls: Sequence[str], timeout: float = 10.0) -> Snapshot:
    """Every server's scrape summed (a role's servers behind one router)."""
    total = Snapshot({})
    for url in base_urls:
        total = total + scrape(url, timeout)
    return total


def settle(
    base_url: str | Sequence[str],
    before: Snapshot,
    done: Callable[[Snapshot], bool],
    deadline_s: float = 20.0,
    interval_s: float = 0.25,
) -> Snapshot:
    """Scrape until ``done(delta)``; stats reach /metrics a moment after a reply.
    ``base_url`` may be several servers' (their scrapes summed).

    Returns the last delta either way: the caller's assertions say what is
    missing, with the numbers.
    """
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    return wait.poll_last(
        lambda: scrape_sum(urls) - before,
        done,
        deadline_s,
        ", ".join(f"{url}/metrics" for url in urls),
        interval_s,
    )[1]


def settle_counts(
    base_url: str | Sequence[str],
    before: Snapshot,
    read: Callable[[Snapshot], dict[str, float]],
    ended: Callable[[dict[str, float]], float],
    deadline_s: float,
) -> dict[str, float]:
    """``read`` of the delta once it stops moving (bounded): when ``ended``
    of it is at least 1 (a transfer in, a failure) and three scrapes in a
    row, half a second apart, read the same. For counters whose final count
    is not known (requests may share transfers)."""
    seen: list[dict[str, float]] = []

    def landed(d: Snapshot) -> bool:
        values = read(d)
        seen.append(values)
        return ended(values) >= 1 and len(seen) >= 3 and seen[-3] == seen[-2] == values

    return read(settle(base_url, before, landed, deadline_s, interval_s=0.5))
