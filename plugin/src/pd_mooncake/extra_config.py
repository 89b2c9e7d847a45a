"""Validation of ``kv_connector_extra_config`` at start-up.

Upstream reads these keys with ``dict.get`` and a default, so a typo such as
``"mooncake_protocl"`` silently falls back to RDMA and fails much later, far
from its cause. Here every key is checked once, before anything starts.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

PROTOCOLS = ("tcp", "rdma")

# Keys the vLLM 0.32 MooncakeConnector reads, with their expected types.
UPSTREAM_KEYS: dict[str, type | tuple[type, ...]] = {
    "mooncake_protocol": str,
    "device_name": str,
    "num_workers": int,
    "bootstrap_server_address": str,
}
# Keys this plugin adds.
PLUGIN_KEYS: dict[str, type | tuple[type, ...]] = {
    # Force the mixed MLA + Eagle registration backport even where upstream
    # has the fix; for tests that compare the two paths.
    "force_registration_backport": bool,
    # Prefill: bind the ZMQ side channel to bootstrap port + offset (+ rank)
    # instead of a random port, so a restarted prefill keeps its address
    # (with a configured engine_id; see reliability).
    "side_channel_port_offset": int,
    # Decode: seconds between probes of a pending pull's prefill; a pull is
    # failed when the prefill refuses connections twice (0: never probe).
    "prefill_liveness_interval_s": (int, float),
    # Both roles: prefill digests the KV it sends, decode verifies what
    # landed before the request runs (pd_mooncake.checksum). Both must agree.
    "kv_checksum": bool,
    # Prefill: seconds without a descriptor of a send completing before the
    # pending ones are sent again (pd_mooncake.stall_guard); > 0.
    "send_stall_s": (int, float),
    # Both roles: MiB of a registered staging buffer; decode offers a span of
    # it per pull, prefill sends a request's blocks through its own as a few
    # large descriptors (pd_mooncake.staging). 0: one descriptor per block run.
    "kv_staging_mib": int,
}
KNOWN_KEYS = {**UPSTREAM_KEYS, **PLUGIN_KEYS}


class ExtraConfigError(ValueError):
    """A bad ``kv_connector_extra_config``; the message names the key."""


def validate(extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        expected = KNOWN_KEYS.get(key)
        if expected is None:
            close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ExtraConfigError(
                f"kv_connector_extra_config: unknown key {key!r}{hint} "
                f"(known: {', '.join(sorted(KNOWN_KEYS))})"
            )
        # bool is an int subclass: do not let True pass as a worker count.
        if not isinstance(value, expected) or (
            expected is int and isinstance(value, bool)
        ):
            raise ExtraConfigError(
                f"kv_connector_extra_config[{key!r}] must be "
                f"{_type_name(expected)}, got {value!r}"
            )
    protocol = extra.get("mooncake_protocol", "rdma")
    if protocol not in PROTOCOLS:
        raise ExtraConfigError(
            f"kv_connector_extra_config['mooncake_protocol'] must be one of "
            f"{', '.join(PROTOCOLS)}, got {protocol!r}"
        )
    offset = extra.get("side_channel_port_offset", 1)
    if offset < 1:
        raise ExtraConfigError(
            "kv_connector_extra_config['side_channel_port_offset'] must be >= 1 "
            f"(0 is the bootstrap server's own port), got {offset}"
        )
    interval = extra.get("prefill_liveness_interval_s", 0)
    if isinstance(interval, bool) or interval < 0:
        raise ExtraConfigError(
            "kv_connector_extra_config['prefill_liveness_interval_s'] must be a "
            f"number >= 0, got {interval!r}"
        )
    stall = extra.get("send_stall_s", 1)
    if isinstance(stall, bool) or stall <= 0:
        raise ExtraConfigError(
            "kv_connector_extra_config['send_stall_s'] must be a number > 0, "
            f"got {stall!r}"
        )
    if extra.get("kv_staging_mib", 0) < 0:
        raise ExtraConfigError(
            "kv_connector_extra_config['kv_staging_mib'] must be >= 0, "
            f"got {extra['kv_staging_mib']}"
        )
    workers = extra.get("num_workers", 1)
    if workers < 1:
        raise ExtraConfigError(
            f"kv_connector_extra_config['num_workers'] must be >= 1, got {workers}"
        )


def _type_name(expected: type | tuple[type, ...]) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__
