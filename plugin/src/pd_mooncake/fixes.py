"""Which of the plugin's fixes attach to the installed vLLM, checked at start-up.

The connector overrides private upstream methods and relies on upstream
building its worker through the module-global name ``MooncakeConnectorWorker``.
A rename or a new parameter in a vLLM release would not fail loudly: an
override that is never called, or a ``getattr`` default, silently turns a fix
off. So every upstream name a fix overrides, calls or reads is listed here
with the signature it needs, checked against upstream's *source* (``ast``,
never imported: the contract test runs the same check on a release that is not
installed), reported in one log line, and a fix the configuration relies on
that cannot attach stops start-up unless ``PD_MOONCAKE_ALLOW_MISSING_FIXES``
names it (or is ``all``).

The table is also a patch queue: each fix names the upstream issue or PR it
answers and when it can be deleted; ``python -m pd_mooncake.fixes --report``
(``make fixes-report``, pd_mooncake.fixes_report) prints, per vLLM release,
which fixes attach and which upstream has made unnecessary.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pd_mooncake.upstream_source import (
    Attr,
    Calls,
    Method,
    Need,
    SourceView,
    StoresOnly,
)

logger = logging.getLogger("vllm.pd_mooncake")

# Comma-separated fix names (or "all") allowed not to attach.
ALLOW_ENV = "PD_MOONCAKE_ALLOW_MISSING_FIXES"

WORKER = "MooncakeConnectorWorker"
CONNECTOR = "MooncakeConnector"

# What the registration backport (connector._apply_plan) sets; anything else
# upstream's register_kv_caches stores would be missing on the backport path.
BACKPORT_SETS = frozenset(
    {
        "num_blocks",
        "kv_caches_base_addr",
        "seen_base_addresses",
        "block_len_per_layer",
        "device_kv_caches",
        "kv_block_len_per_layer",
        "registered_layer_names",
        "registered_layer_indices",
        "registered_group_indices",
        "region_shared_groups",
        "region_row_offsets",
        "opaque_packed_storages",
    }
)
# The same on a worker from before PR 39596 (vLLM 0.19.x), which keeps less.
LEGACY_BACKPORT_SETS = frozenset(
    {
        "num_blocks",
        "kv_caches_base_addr",
        "seen_base_addresses",
        "block_len_per_layer",
        "device_kv_caches",
    }
)


class FixNotAttachedError(RuntimeError):
    """A fix the configuration relies on cannot attach to this vLLM."""


@dataclass(frozen=True)
class Fix:
    name: str
    needs: tuple[Need, ...]
    # (extra config, is_producer, is_consumer) -> does this configuration rely on it.
    relied_on: Callable[[Mapping[str, Any], bool, bool], bool] = field(
        default=lambda extra, producer, consumer: True
    )
    # Another upstream shape the fix attaches to as well (e.g. a release
    # from before the code it works around changed): met if either is.
    or_needs: tuple[Need, ...] = ()
    # The patch queue. What upstream lacks: the issue or PR, or the upstream
    # code, the fix answers (a feature says so).
    answers: str = field(kw_only=True)
    # When it can be deleted: a release that has X.
    retire_when: str = field(kw_only=True)
    # Upstream code that shows X is there, read like ``needs``: all met ->
    # the fix is no longer needed on that release (empty: not detectable).
    retired_by: tuple[Need, ...] = field(default=(), kw_only=True)


def _liveness_on(extra: Mapping[str, Any], producer: bool, consumer: bool) -> bool:
    from pd_mooncake.connector import LIVENESS_INTERVAL_S

    return consumer and bool(
        extra.get("prefill_liveness_interval_s", LIVENESS_INTERVAL_S)
    )


def _fault_on(extra: Mapping[str, Any], producer: bool, consumer: bool) -> bool:
    from pd_mooncake import faults

    return faults.active_fault() is not None


def _checksum_on(extra: Mapping[str, Any], producer: bool, consumer: bool) -> bool:
    return bool(extra.get("kv_checksum"))


def _staging_on(extra: Mapping[str, Any], producer: bool, consumer: bool) -> bool:
    from pd_mooncake import staging

    return bool(extra.get(staging.KEY))


def _backport_on(extra: Mapping[str, Any], producer: bool, consumer: bool) -> bool:
    """Asked for, or needed: upstream without PR 39596 (vLLM 0.19.x) dies on
    the seed's assertion for an MLA target with a GQA draft."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
        mooncake_connector as upstream,
    )

    from pd_mooncake import registration

    return bool(
        extra.get("force_registration_backport")
    ) or not registration.upstream_has_fix(upstream.MooncakeConnectorWorker)


# The side channel's messages as pd_mooncake.wire extends them: pulls and
# answers encoded with the worker's encoder and decoded with its decoders, in
# the tasks whose context the features read; answers reach
# process_pulling_result.
WIRE_NEEDS: tuple[Need, ...] = (
    Calls(WORKER, "send_kv_to_decode", "self._encoder.encode"),
    Calls(WORKER, "receive_kv_from_single_worker", "self._encoder.encode"),
    Calls(
        WORKER,
        "receive_kv_from_single_worker",
        "self._xfer_resp_decoder.decode",
    ),
    Calls(WORKER, "_sender_worker", "self._xfer_meta_decoder.decode"),
    Calls(WORKER, "receive_kv_from_single_worker", "self.process_pulling_result"),
)

FIXES: tuple[Fix, ...] = (
    Fix(
        # Every worker-side fix: upstream must build our worker class.
        "worker_class",
        (
            # Upstream's own arguments are passed through (0.19.x has no
            # kv_cache_config).
            Method(WORKER, "__init__", ("vllm_config", "engine_id"), leading=True),
            Method(CONNECTOR, "__init__", ("vllm_config", "role", "kv_cache_config")),
            Calls(CONNECTOR, "__init__", WORKER),
        ),
        answers="upstream's MooncakeConnector builds MooncakeConnectorWorker by its "
        "module-global name and offers no worker-class option (this fix swaps the "
        "name during construction; it only carries the worker-side fixes)",
        retire_when="every worker-side fix below is retired, or a release whose "
        "connector takes a worker class",
    ),
    Fix(
        "registration_backport",
        (
            Method(WORKER, "register_kv_caches", ("kv_caches",)),
            Method(WORKER, "_mooncake_sender_listener", ("ready_event",), True),
            Attr(WORKER, "sender_loop"),
            Attr(WORKER, "engine"),
            Attr(WORKER, "_physical_blocks_per_logical_kv_block"),
            Attr(WORKER, "_layer_specs"),
            Attr(WORKER, "_prepared_transfer_regions"),
            StoresOnly(WORKER, "register_kv_caches", BACKPORT_SETS),
        ),
        _backport_on,
        # Before PR 39596 (0.19.x): no kv_cache_config, one block size for
        # every tensor (worker_regions._register_legacy).
        (
            Method(WORKER, "register_kv_caches", ("kv_caches",)),
            Method(WORKER, "_mooncake_sender_listener", ("ready_event",), True),
            Attr(WORKER, "sender_loop"),
            Attr(WORKER, "engine"),
            Attr(WORKER, "kv_topo"),
            Calls(WORKER, "register_kv_caches", "self.engine.batch_register_memory"),
            StoresOnly(WORKER, "register_kv_caches", LEGACY_BACKPORT_SETS),
        ),
        answers="vllm PR 39596 ([Mooncake] Fix mixed MLA+Eagle block-size "
        "validation): before it an MLA target with a GQA Eagle draft dies on "
        "register_kv_caches' block-size assertion",
        retire_when="the oldest vLLM the plugin supports has PR 39596 (vLLM >= 0.20; "
        "kept for 0.19.x)",
        retired_by=(Method(WORKER, "_sync_block_size_with_kernel", ()),),
    ),
    Fix(
        "send_retry",
        (
            Method(
                WORKER,
                "_send_blocks",
                ("remote_session", "src_ptrs", "dst_ptrs", "lengths"),
            ),
            # The override replaces upstream's body (stall_guard instead of
            # one sync batch) and records the stats upstream's did.
            Calls(WORKER, "_send_blocks", "self.xfer_stats.record_transfer"),
            Calls(WORKER, "_send_blocks", "self.xfer_stats.record_failed_transfer"),
            Attr(WORKER, "xfer_stats"),
        ),
        lambda extra, producer, consumer: producer,
        answers="kvcache-ai/Mooncake#4209 (a TCP transfer stalls until a new "
        "submission); upstream's _send_blocks waits out one synchronous batch "
        "(30 s) and fails the request",
        retire_when="the Mooncake the images pin has #4209's fix, or a vLLM whose "
        "_send_blocks resubmits a stalled batch itself",
    ),
    Fix(
        # send_deadline.SendTimeouts / StampedQueue / SessionExecutor: no send
        # attempt outlives decode's wait, one silent decode holds no thread a
        # healthy decode needs.
        "send_deadline",
        (
            Method(WORKER, "send_kv_to_decode", ("identity", "sock", "meta"), True),
            Method(WORKER, "_bind_sender_thread_device", ()),
            Attr(WORKER, "_sender_executor"),
            Attr(WORKER, "sender_worker_queue"),
            Attr(WORKER, "num_sender_workers"),
            # Sends run in the executor with the session first (SessionExecutor
            # keys its pools by it) and the pull's clock in the context.
            Calls(WORKER, "send_kv_to_decode", "self.sender_loop.run_in_executor"),
        ),
        lambda extra, producer, consumer: producer,
        answers="no upstream issue found (vLLM issues searched 2026-12-02): "
        "upstream's sends share one executor, so one silent decode holds the "
        "threads a healthy decode needs, and a send may outlive decode's wait",
        retire_when="a vLLM whose sends are bounded by decode's wait and kept apart "
        "per decode session",
    ),
    Fix(
        "rejection_release",
        (
            Method(WORKER, "send_kv_to_decode", ("identity", "sock", "meta"), True),
            Attr(WORKER, "reqs_need_send"),
            Attr(WORKER, "finished_sending_reqs"),
            Attr("MooncakeXferMetadata", "req_blocks"),
            Attr("SendBlockMeta", "p_req_id"),
            Attr("SendBlockMeta", "sending"),
        ),
        lambda extra, producer, consumer: producer,
        answers="vllm PR 41269's rejection notice (decode asks with no blocks under "
        "the API request's transfer id) names the API request; with per-engine-"
        "request ids (sibling_transfer_ids) upstream frees none of its siblings' "
        "sends, which keep prefill's blocks until the abort timeout",
        retire_when="sibling_transfer_ids is retired (a vLLM that derives an id per "
        "engine request frees them itself)",
    ),
    Fix(
        "not_processed_guard",
        (
            Method(WORKER, "record_send_reqs", ("metadata",), True),
            Attr("MooncakeConnectorMetadata", "reqs_not_processed"),
        ),
        lambda extra, producer, consumer: producer,
        answers="no upstream issue found: upstream's record_send_reqs pops each "
        "'not processed' transfer id without a default, so one id it never "
        "registered raises KeyError and stops the rest of the batch",
        retire_when="a vLLM whose record_send_reqs skips unknown 'not processed' ids",
    ),
    Fix(
        "dead_prefill_probe",
        (
            Method(
                WORKER,
                "receive_kv_from_single_worker",
                ("worker_addr", "pull_metas"),
                True,
            ),
            Method(WORKER, "_handle_failed_recv", ("pull_metas", "req_ids", "reason")),
            Method(WORKER, "process_pulling_result", ("response", "pull_metas")),
            # The probe fails the requests upstream's pull still owes, read from
            # the dict upstream settles from, which the pull hands to these two
            # (pd_mooncake.pull._Settling: 0.33 settles a copy of pull_metas).
            Calls(
                WORKER, "receive_kv_from_single_worker", "self.process_pulling_result"
            ),
            Calls(WORKER, "receive_kv_from_single_worker", "self._handle_failed_recv"),
            Attr("PullReqMeta", "remote_bootstrap_addr"),
            Attr("PullReqMeta", "remote_engine_id"),
            # A re-created prefill's engine id is dropped from upstream's
            # cache of side-channel addresses, so the next pull asks anew.
            Attr(WORKER, "_remote_agents"),
        ),
        _liveness_on,
        answers="vllm#35943 and vllm#55870 (both open): a pull from a dead or "
        "restarted prefill waits VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s "
        "(540 s) in WAITING_FOR_REMOTE_KVS",
        retire_when="a vLLM that fails a pending pull when its prefill's bootstrap "
        "server refuses or re-registers the engine (vllm#35943 closed by a fix)",
    ),
    Fix(
        "fixed_side_channel",
        (
            Calls(WORKER, "_mooncake_sender_listener", "sock.bind_to_random_port"),
            Attr(WORKER, "async_zmq_ctx"),
            *(
                Attr(WORKER, a)
                for a in ("dp_rank", "pp_rank", "pp_size", "tp_rank", "tp_size")
            ),
            Method("", "get_mooncake_bootstrap_addr", ("vllm_config",)),
        ),
        lambda extra, producer, consumer: bool(extra.get("side_channel_port_offset")),
        answers="no upstream issue found: upstream binds the side channel with "
        "bind_to_random_port, so a restarted prefill is unreachable at the address "
        "decode cached",
        retire_when="a vLLM whose side-channel port is configurable per rank",
    ),
    Fix(
        "sibling_transfer_ids",
        (
            Method(CONNECTOR, "on_new_request", ("request",)),
            Method(
                CONNECTOR,
                "update_state_after_alloc",
                ("request", "blocks", "num_external_tokens"),
            ),
            Method(CONNECTOR, "request_finished", ("request", "block_ids")),
            Method(CONNECTOR, "request_finished_all_groups", ("request", "block_ids")),
            Method(CONNECTOR, "update_connector_output", ("connector_output",)),
            Attr(CONNECTOR, "connector_scheduler"),
        ),
        answers="no upstream issue found: the engine requests of one API request "
        "(n > 1 children, batch prompts) share the router's transfer_id, so a "
        "batch's second prompt decodes from the first's KV",
        retire_when="a vLLM (or router) that gives each engine request its own "
        "transfer id, the same on both legs",
    ),
    Fix(
        # pd_mooncake.checksum: prefill's digests ride on its answer, decode
        # verifies before upstream reports the request received.
        "kv_checksum",
        (
            Method(
                WORKER,
                "_build_transfer_params",
                ("ready_reqs", "agent_meta", "local_regions", "remote_regions"),
                True,
            ),
            Calls(WORKER, "send_kv_to_decode", "self._build_transfer_params"),
            # The answer is encoded with the worker's encoder, in the task that
            # built the send (the digests wait in a context variable).
            *WIRE_NEEDS,
            Method(WORKER, "process_pulling_result", ("response", "pull_metas")),
            Method(WORKER, "_handle_failed_recv", ("pull_metas", "req_ids", "reason")),
            Method(WORKER, "_logical_to_kernel_block_ids", ("block_ids",)),
            Method(
                "",
                "_block_ids_for_region",
                ("block_ids_by_group", "group_index", "shared_group_ids"),
            ),
            *(
                Attr(WORKER, a)
                for a in (
                    "_encoder",
                    "_xfer_meta_decoder",
                    "_xfer_resp_decoder",
                    "device_kv_caches",
                    "kv_caches_base_addr",
                    "block_len_per_layer",
                    "kv_block_len_per_layer",
                    "registered_layer_names",
                    "registered_group_indices",
                    "region_shared_groups",
                    "tp_size",
                    "pp_size",
                    "reqs_need_send",
                    "finished_sending_reqs",
                )
            ),
            Attr("SendBlockMeta", "transfer_id"),
            Attr("SendBlockMeta", "p_req_id"),
            Attr("MooncakeXferResponse", "ok_reqs"),
            Attr("MooncakeXferMetadata", "req_blocks"),
            Attr("MooncakeXferMetadata", "remote_tp_size"),
            Attr("MooncakeXferMetadata", "remote_pp_size"),
            Attr("SendBlockMeta", "local_block_ids"),
            Attr("PullReqMeta", "local_block_ids"),
            Attr("PullReqMeta", "failed"),
        ),
        _checksum_on,
        answers="a feature upstream lacks (no vLLM issue): nothing checks the KV "
        "decode received against what prefill sent",
        retire_when="a vLLM whose connector verifies received KV itself",
    ),
    Fix(
        # pd_mooncake.staging: decode offers a span in its pull, prefill
        # writes a record there and names it in its answer, decode copies the
        # record into the blocks before upstream reports them received.
        "kv_staging",
        (
            Method(
                WORKER,
                "_send_blocks",
                ("remote_session", "src_ptrs", "dst_ptrs", "lengths"),
            ),
            Method(WORKER, "send_kv_to_decode", ("identity", "sock", "meta"), True),
            Method(
                WORKER,
                "receive_kv_from_single_worker",
                ("worker_addr", "pull_metas"),
                True,
            ),
            Method(WORKER, "process_pulling_result", ("response", "pull_metas")),
            Method(WORKER, "_handle_failed_recv", ("pull_metas", "req_ids", "reason")),
            Method(WORKER, "_logical_to_kernel_block_ids", ("block_ids",)),
            # Sends run in the executor with the pull's context (the target).
            Calls(WORKER, "send_kv_to_decode", "self.sender_loop.run_in_executor"),
            *WIRE_NEEDS,
            *(
                Attr(WORKER, a)
                for a in (
                    "engine",
                    "_encoder",
                    "_xfer_meta_decoder",
                    "_xfer_resp_decoder",
                    "device_kv_caches",
                    "block_len_per_layer",
                )
            ),
            Attr("MooncakeXferResponse", "ok_reqs"),
            Attr("PullReqMeta", "local_block_ids"),
            # A request over one span goes in chunks (staging_worker): prefill
            # slices the build and keeps a chunk before the last from counting
            # as the request's send.
            Method(
                WORKER,
                "_build_transfer_params",
                ("ready_reqs", "agent_meta", "local_regions", "remote_regions"),
                True,
            ),
            Attr("SendBlockMeta", "need_send"),
            Attr("SendBlockMeta", "expire_time"),
        ),
        _staging_on,
        answers="a feature upstream lacks (no vLLM issue): one Mooncake descriptor "
        "per block run and region, and Mooncake's TCP transport pays per "
        "descriptor",
        retire_when="a vLLM that coalesces a pull's blocks into few descriptors, or "
        "a Mooncake TCP transport without the per-descriptor cost",
    ),
    Fix(
        # pd_mooncake.block_hold: a failed direct pull's request is reported
        # finished receiving (what vLLM frees its blocks on) only once no
        # write to them can land; the failure itself goes at once.
        "failed_pull_block_hold",
        (
            Method(WORKER, "_handle_failed_recv", ("pull_metas", "req_ids", "reason")),
            Method(WORKER, "fetch_finished_recving_reqs", (), True),
            # The report reaches the scheduler only through the override.
            Calls(WORKER, "get_finished", "self.fetch_finished_recving_reqs"),
            Attr(WORKER, "finished_recving_reqs"),
            Attr("PullReqMeta", "failed"),
            Attr("PullReqMeta", "local_block_ids"),
        ),
        lambda extra, producer, consumer: consumer,
        answers="no upstream issue found: upstream reports a failed pull's "
        "request finished receiving at once, so vLLM frees its blocks while a "
        "write prefill submitted into them may still land (TCP retransmits, a "
        "resend's orphan)",
        retire_when="a vLLM whose connector holds a failed load's blocks until "
        "the writes into them have ended",
    ),
    Fix(
        # pd_mooncake.finished_rounds: a round to the loops only when a loop
        # recorded something, else every SWEEP_S (clock-driven reports).
        "quiet_finished_rounds",
        (
            Method(WORKER, "get_finished", ()),
            Calls(WORKER, "get_finished", "self.fetch_finished_recving_reqs"),
            Calls(WORKER, "get_finished", "self.fetch_finished_sending_reqs"),
            Attr(WORKER, "finished_recving_reqs"),
            Attr(WORKER, "finished_sending_reqs"),
        ),
        answers="no upstream issue found: upstream's get_finished runs a "
        "coroutine on each of its event loops after every engine step, waking "
        "both loop threads while nothing finished (0.05 CPU-s per second on "
        "prefill's, one request waiting for decode's pull, 2026-12-03)",
        retire_when="a vLLM whose get_finished reads what the loops recorded "
        "without a round per step",
    ),
    Fix(
        "received_kv_fault",
        (
            Method(WORKER, "process_pulling_result", ("response", "pull_metas")),
            Attr(WORKER, "device_kv_caches"),
            Attr("MooncakeXferResponse", "ok_reqs"),
            Attr("PullReqMeta", "local_block_ids"),
        ),
        _fault_on,
        answers="not a fix: the fault suite's hook (pd_mooncake.faults) that "
        "corrupts received KV on purpose",
        retire_when="the fault suite no longer needs it",
    ),
)


@dataclass(frozen=True)
class Report:
    attached: tuple[str, ...]
    missing: dict[str, list[str]]  # fix -> problems
    # Fixes whose retired_by upstream code is there (attached or not).
    retired: tuple[str, ...] = ()

    def line(self) -> str:
        text = f"PD Mooncake fixes attached: {', '.join(self.attached) or 'none'}"
        if self.missing:
            text += "; NOT attached: " + "; ".join(
                f"{fix} ({', '.join(problems)})"
                for fix, problems in self.missing.items()
            )
        return text


def check(view: SourceView, fixes: tuple[Fix, ...] = FIXES) -> Report:
    attached, missing, retired = [], {}, []
    for fix in fixes:
        if fix.retired_by and not any(map(view.problem, fix.retired_by)):
            retired.append(fix.name)
        problems = [p for p in map(view.problem, fix.needs) if p is not None]
        if problems and fix.or_needs:
            other = [p for p in map(view.problem, fix.or_needs) if p is not None]
            problems = [*problems, f"nor the older shape ({', '.join(other)})"]
            problems = problems if other else []
        if problems:
            missing[fix.name] = problems
        else:
            attached.append(fix.name)
    return Report(tuple(attached), missing, tuple(retired))


@functools.cache
def installed_view() -> SourceView:
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
        mooncake_connector,
    )

    return SourceView(inspect.getsource(mooncake_connector), inspect.getsource(base))


def installed_report() -> Report:
    """Which fixes attach to the installed vLLM: the worker and connector
    leave an unattached fix's override to upstream (the source is parsed
    once per process, installed_view)."""
    return check(installed_view())


def upstream_prom_metrics() -> type | None:
    """Upstream's own Mooncake Prometheus metrics (vLLM 0.33 has them), by feature."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import stats
    except ImportError:  # vLLM 0.19.x: no Mooncake stats module at all
        return None

    return getattr(stats, "MooncakePromMetrics", None)


def enforce(
    extra: Mapping[str, Any],
    *,
    producer: bool,
    consumer: bool,
    view: SourceView | None = None,
) -> Report:
    """Log which fixes attach; raise if one this configuration relies on does not."""
    report = check(view) if view is not None else installed_report()
    metrics_owner = "upstream" if upstream_prom_metrics() else "plugin"
    logger.info("%s; transfer metrics: %s", report.line(), metrics_owner)
    allowed = {a.strip() for a in os.environ.get(ALLOW_ENV, "").split(",") if a.strip()}
    needed = {
        fix.name: report.missing[fix.name]
        for fix in FIXES
        if fix.name in report.missing
        and fix.relied_on(extra, producer, consumer)
        and not ({fix.name, "all"} & allowed)
    }
    if needed:
        details = "; ".join(f"{name}: {', '.join(p)}" for name, p in needed.items())
        raise FixNotAttachedError(
            f"PD Mooncake: this configuration relies on fixes that cannot attach to "
            f"the installed vLLM ({details}). Use a vLLM release the plugin supports, "
            f"or set {ALLOW_ENV}={','.join(needed)} to start without them."
        )
    return report


if __name__ == "__main__":
    from pd_mooncake import fixes_report

    sys.exit(fixes_report.main())
