"""PDMooncakeConnector: upstream's MooncakeConnector with this plugin's fixes.

Subclasses keep upstream's transfer logic; each override says why it exists.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from pd_mooncake import (
    checksum,
    cpu_support,
    extra_config,
    fixes,
    geometry,
    registration,
    reliability,
    send_deadline,
    staging,
    stall_guard,
    tcp_limits,
)
from pd_mooncake.finished_rounds import FinishedRounds
from pd_mooncake.metrics import (
    PDMooncakePromMetrics,
    PDMooncakeStats,
    sending_descriptors,
)
from pd_mooncake.pull import PullWorker
from pd_mooncake.staging_worker import Staged, StagingWorker
from pd_mooncake.worker_regions import RegionsWorker

# Under "vllm." so vLLM's logging configuration (handler, level) applies.
logger = logging.getLogger("vllm.pd_mooncake")

# Prefill: a stalled transfer's pending descriptors are sent again while they
# could still end (send_deadline.SendTimeouts.attempt_s, Mooncake's own slice
# timeouts) within this many seconds of the first submission (_send_blocks).
# The hard bound is decode's wait for the pull (SendTimeouts.may_start): no
# resend starts that could still be writing when decode gives up.
SEND_RETRY_BUDGET_S = 120.0
# Mooncake's transfer timeout (MC_TRANSFER_TIMEOUT), its 0.3.x default.
MOONCAKE_TRANSFER_TIMEOUT_S = 30.0
# Decode: seconds between probes of a pending pull's prefill (reliability).
LIVENESS_INTERVAL_S = 2.0
# kv_transfer_params key: the API request's transfer id, once a request has
# its own (reliability.sibling_transfer_id).
SIBLING_BASE = "pd_api_transfer_id"


def _transfer_timeout() -> float:
    limit = os.environ.get("MC_TRANSFER_TIMEOUT", "")
    return float(limit) if limit.isdigit() else MOONCAKE_TRANSFER_TIMEOUT_S


def _request_ids_randomized() -> bool:
    """vLLM appends a random suffix to engine request ids unless told not to
    (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION; read once per process)."""
    from vllm import envs

    return not envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION


@contextlib.contextmanager
def _upstream_builds(worker_cls: type) -> Iterator[None]:
    """Make upstream's constructor build our worker instead of its own.

    Upstream's ``MooncakeConnector.__init__`` instantiates the module-global
    ``MooncakeConnectorWorker``; swapping that name for the duration of the
    call keeps every other line of upstream's constructor (which differs
    between vLLM releases) untouched. Construction is single-threaded.
    """
    original = upstream.MooncakeConnectorWorker
    upstream.MooncakeConnectorWorker = worker_cls
    try:
        yield
    finally:
        upstream.MooncakeConnectorWorker = original


class PDMooncakeConnectorWorker(
    FinishedRounds,
    RegionsWorker,
    geometry.GeometryWorker,
    PullWorker,
    checksum.ChecksumWorker,
    StagingWorker,
    upstream.MooncakeConnectorWorker,
):
    # Prefill: seconds without a descriptor completing before the pending
    # ones are sent again (kv_connector_extra_config.send_stall_s).
    stall_s: float = stall_guard.DEFAULT_STALL_S
    _orphans: stall_guard.Orphans | None = None

    def __init__(self, vllm_config: Any, engine_id: str, *upstream_args: Any) -> None:
        # upstream_args: what the installed release's connector passes after
        # the engine id (kv_cache_config since 0.20; nothing on 0.19.x).
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        # Upstream's default protocol is rdma.
        self.protocol = extra.get("mooncake_protocol", "rdma")
        # Before super(): the TransferEngine reads these when it is built.
        tcp_limits.raise_queue_limits(self.protocol)
        with cpu_support.cpu_device_index():
            super().__init__(vllm_config, engine_id, *upstream_args)
        # Where upstream has PR 39596 the backport runs only when asked for
        # (to compare with it); before it (0.19.x), always: upstream's own
        # registration dies on the seed's assertion.
        self.backport = bool(
            extra.get("force_registration_backport")
        ) or not registration.upstream_has_fix(upstream.MooncakeConnectorWorker)
        # A fix that does not attach to this release leaves upstream's
        # behaviour alone (fixes.enforce has refused or allowed it already).
        attached = fixes.installed_report().attached
        self.xfer_stats = PDMooncakeStats()
        self.regions: list[registration.Region] = []
        offset = extra.get("side_channel_port_offset")
        if offset and not self.is_kv_consumer and "fixed_side_channel" in attached:
            self._use_fixed_side_channel(vllm_config, offset)
        self.randomized_ids = _request_ids_randomized()
        # Decode: probe a pending pull's prefill this often (0: never).
        self.liveness_interval_s = float(
            extra.get("prefill_liveness_interval_s", LIVENESS_INTERVAL_S)
            if "dead_prefill_probe" in attached
            else 0
        )
        if not self.is_kv_consumer and "send_deadline" in attached:
            self._bound_sends(os.environ)
        self.stall_s = float(extra.get("send_stall_s", stall_guard.DEFAULT_STALL_S))
        self._install_checksum(extra if "kv_checksum" in attached else {})
        self._install_staging(extra if "kv_staging" in attached else {})
        self.hold_failed_blocks = "failed_pull_block_hold" in attached
        if self.is_kv_consumer and not self.staging_bytes and self.hold_failed_blocks:
            self._state_block_hold(vllm_config)
        self._install_geometry()

    def _bound_sends(self, env: Any) -> None:
        """Prefill: fail start-up on timeouts that let a send outlive decode's
        wait, and give sends the pull's clock and per-decode threads."""
        self.send_timeouts = send_deadline.SendTimeouts.from_env(env)
        self.send_timeouts.check()
        # Still empty: the listener starts in register_kv_caches.
        self.sender_worker_queue = send_deadline.StampedQueue()
        shared = self._sender_executor
        self._sender_executor = send_deadline.SessionExecutor(
            self.num_sender_workers, initializer=self._bind_sender_thread_device
        )
        shared.shutdown(wait=False)

    def _use_fixed_side_channel(self, vllm_config: Any, offset: int) -> None:
        """A restarted prefill comes back at the same side-channel address,
        which decode caches per engine id (see reliability)."""
        port = reliability.side_channel_port(
            upstream.get_mooncake_bootstrap_addr(vllm_config)[1],
            offset,
            dp_rank=self.dp_rank,
            pp_rank=self.pp_rank,
            tp_rank=self.tp_rank,
            pp_size=self.pp_size,
            tp_size=self.tp_size,
        )
        # No socket exists yet: the listener starts in register_kv_caches.
        self.async_zmq_ctx.term()
        self.async_zmq_ctx = reliability.SideChannelContext()
        self.async_zmq_ctx.side_channel_port = port
        logger.info("PD Mooncake: side channel on fixed port %d", port)

    # -- registration ---------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.backport:
            self._register_backport(kv_caches)
        else:
            super().register_kv_caches(kv_caches)
        self.regions = self._describe_regions(kv_caches)
        self._kv_pages = None
        if self.kv_checksum:
            self._checksum_pages()
        self._register_staging()
        self.xfer_stats.region_map = self._region_map()
        self._log_region_report()
        self._state_geometry()
        tcp_limits.warn_if_prompt_can_overflow(
            self.protocol,
            self.vllm_config.model_config.max_model_len,
            # Upstream set block_size to the kernel block size.
            self.block_size,
            len(self.regions),
        )

    # -- transfer -------------------------------------------------------------
    @property
    def send_orphans(self) -> stall_guard.Orphans:
        if self._orphans is None:
            self._orphans = stall_guard.Orphans()
        return self._orphans

    def _send_blocks(
        self,
        remote_session: str,
        src_ptrs: list[int],
        dst_ptrs: list[int],
        lengths: list[int],
    ) -> int:
        """Upstream's send, never raising: upstream's send_kv_to_decode
        counts the send in ``SendBlockMeta.sending`` before it and uncounts
        it only when it returns (mooncake_connector.py), and its expiry frees
        a request's blocks only at 0. A raise (the staging gather re-raises a
        bad range) would hold the requests' blocks until restart; a failed
        send is reported as upstream reports one (its requests failed, their
        blocks freed at the abort timeout). The write has settled by then
        (stall_guard.write, even when it raises)."""
        try:
            return self._write_blocks(remote_session, src_ptrs, dst_ptrs, lengths)
        except Exception:
            logger.exception(
                "PD Mooncake: sending to %s raised; reporting it failed",
                remote_session,
            )
            self.xfer_stats.record_failed_transfer()
            return -1

    def _write_blocks(
        self,
        remote_session: str,
        src_ptrs: list[int],
        dst_ptrs: list[int],
        lengths: list[int],
    ) -> int:
        """Upstream's send (one sync Mooncake batch, its stats and log line),
        with the write through stall_guard: a stall costs ``stall_s``, not
        Mooncake's whole timeout, and resends only what is pending; it
        returns once every submission has settled (send_deadline: the
        late-write rule)."""
        timeouts: send_deadline.SendTimeouts | None = getattr(
            self, "send_timeouts", None
        )
        # Set by send_kv_to_decode for the pull this send answers; None when
        # called outside one (then only the budget bounds resends).
        clock = send_deadline.PULL_CLOCK.get()
        attempt_s = timeouts.attempt_s if timeouts else _transfer_timeout()

        def too_late(now: float) -> bool:
            if clock is None or timeouts is None:
                return False
            return not timeouts.may_start(now, clock.last_message)

        first = time.monotonic()
        # The descriptors written: upstream's, or a staged record's chunks.
        write: tuple[list[int], list[int], list[int]] = (src_ptrs, dst_ptrs, lengths)
        staged: Staged | None = None

        def may_resend(now: float) -> bool:
            # Submitted slices can write until Mooncake's own attempt
            # timeouts end them: no resend that could outlast the budget or
            # decode's wait.
            return now - first + attempt_s <= SEND_RETRY_BUDGET_S and not too_late(now)

        def on_resend(pending: int) -> None:
            # Mooncake's TCP transport (0.3.13) can leave both peers not
            # reading bytes already in their sockets (seen here and in CI,
            # kvcache-ai/Mooncake#4209 family); a new submission set them
            # moving again. The bytes are the same and decode still waits.
            logger.warning(
                "PD Mooncake: send to %s stalled (%d of %d descriptors pending, "
                "none done in %.1fs, %s); sending those again",
                remote_session,
                pending,
                len(write[0]),
                self.stall_s,
                "a staged record" if staged else "direct",
            )
            self.xfer_stats.record_retry()

        # Lets the stats attribute these bytes to regions (see metrics).
        with sending_descriptors(src_ptrs, lengths):
            if too_late(first):
                # Decode gives up before this attempt could end, and then
                # gives the blocks to another request: do not write.
                logger.warning(
                    "PD Mooncake: send to %s not started: decode stops waiting "
                    "for it in %.1fs, an attempt can take %.0fs",
                    remote_session,
                    timeouts.deadline(clock.last_message) - first,
                    attempt_s,
                )
                self.xfer_stats.record_failed_transfer()
                return -1
            # Few large descriptors where decode offered a span (staging);
            # with an offer, a send staging cannot take fails, never direct.
            try:
                staged = self._stage_send(
                    src_ptrs, dst_ptrs, lengths, lambda now: not too_late(now)
                )
            except staging.NoRoomError as exc:
                logger.warning(
                    "PD Mooncake: send to %s failed: %s", remote_session, exc
                )
                self.xfer_stats.record_failed_transfer()
                return -1
            if staged:
                write = (staged.src, staged.dst, staged.lengths)
            outcome = stall_guard.write(
                self.engine,
                remote_session,
                *write,
                stall_s=self.stall_s,
                may_resend=may_resend,
                orphans=self.send_orphans,
                # Submissions can write until Mooncake's attempt timeouts end
                # them: the send is not reported before.
                settle_s=attempt_s,
                on_resend=on_resend,
            )
            if outcome.held_s >= self.stall_s or outcome.unsettled:
                logger.warning(
                    "PD Mooncake: send to %s held its answer %.1fs for earlier "
                    "submissions to settle (%d still running at %.0fs)",
                    remote_session,
                    outcome.held_s,
                    outcome.unsettled,
                    attempt_s,
                )
            self._staged_sent(
                staged, outcome.status == 0, outcome.resends, outcome.seconds
            )
            if outcome.status == 0:
                self.xfer_stats.record_transfer(
                    # With the gather into the staging buffer, if any.
                    duration_s=time.monotonic() - first,
                    total_bytes=sum(lengths),
                    num_descs=len(write[0]),
                )
            else:
                self.xfer_stats.record_failed_transfer()
                logger.warning(
                    "Sending to %s failed after %.3fs and %d resends "
                    "(%d descriptors, %d bytes)",
                    remote_session,
                    outcome.seconds,
                    outcome.resends,
                    len(write[0]),
                    sum(lengths),
                )
            return outcome.status

    async def _build_transfer_params(
        self,
        ready_reqs: list,
        agent_meta: Any,
        local_regions: list,
        remote_regions: list,
    ) -> tuple[list[int], list[int], list[int], list[str], str | None]:
        """Upstream's (with the checksum's digests), never raising, as
        ``_send_blocks``: upstream's send_kv_to_decode has counted these
        requests in ``SendBlockMeta.sending`` already. Its requests are
        reported failed instead; nothing was submitted."""
        try:
            return await super()._build_transfer_params(
                ready_reqs, agent_meta, local_regions, remote_regions
            )
        except Exception as exc:
            logger.exception("PD Mooncake: building a send raised")
            failed = [d_req_id for d_req_id, _ in ready_reqs]
            return [], [], [], failed, f"building the send failed: {exc}"

    async def send_kv_to_decode(self, identity: bytes, sock: Any, meta: Any) -> None:
        # Before upstream's own checks, whose errors name no flag (geometry).
        refusal = self._geometry_refusal(meta) or self._staging_refusal(meta)
        if refusal is not None:
            await self._refuse_pull(identity, sock, refusal, meta)
            return
        # A rejection notice names the API request: free its siblings too,
        # as upstream frees a send that is done.
        for key in reliability.api_release(
            meta.req_blocks, self.reqs_need_send, randomized=self.randomized_ids
        ):
            self.finished_sending_reqs.add(self.reqs_need_send.pop(key).p_req_id)
        # Decode's clock for this pull started when it arrived (StampedQueue),
        # and restarts at every answer (StampingSocket): _send_blocks reads it.
        arrival = send_deadline.PULL_ARRIVAL.get() or time.monotonic()
        clock = send_deadline.PullClock(arrival)
        token = send_deadline.PULL_CLOCK.set(clock)
        # Decode's staging span for this pull, filled by its sends.
        target = staging.Target.from_wire(getattr(meta, "pd_staging", None))
        target_token = staging.TARGET.set(target)
        # A request decode pulls in chunks: this pull's run of its blocks.
        chunks_token = staging.CHUNKS.set(getattr(meta, "pd_chunk", None))
        try:
            await super().send_kv_to_decode(
                identity, send_deadline.StampingSocket(sock, clock), meta
            )
        finally:
            send_deadline.PULL_CLOCK.reset(token)
            send_deadline.PULL_ARRIVAL.set(None)
            staging.TARGET.reset(target_token)
            staging.CHUNKS.reset(chunks_token)

    async def record_send_reqs(self, metadata: Any) -> None:
        # Upstream pops "not processed" ids without a default (see reliability).
        if metadata.reqs_not_processed:
            metadata.reqs_not_processed = reliability.known_not_processed(
                metadata.reqs_not_processed, self.reqs_need_send
            )
        await super().record_send_reqs(metadata)
        # A refused pull that came before its request was ready (geometry).
        self._release_refused()


class PDMooncakeConnector(upstream.MooncakeConnector):
    def __init__(self, vllm_config: Any, role: Any, *args: Any, **kwargs: Any) -> None:
        # Fail at start-up on a bad extra config, in every role and process.
        kv = vllm_config.kv_transfer_config
        extra_config.validate(kv.kv_connector_extra_config)
        # And on a vLLM the fixes this configuration relies on cannot attach to.
        fixes.enforce(
            kv.kv_connector_extra_config,
            producer=kv.is_kv_producer,
            consumer=kv.is_kv_consumer,
        )
        with _upstream_builds(PDMooncakeConnectorWorker):
            super().__init__(vllm_config, role, *args, **kwargs)
        scheduler = self.connector_scheduler
        self.randomized_ids = _request_ids_randomized()
        # Not on a release whose scheduler hooks differ (fixes.py): upstream's ids.
        self.sibling_ids = "sibling_transfer_ids" in fixes.installed_report().attached
        # Prefill's scheduler: one live request per transfer id (reliability).
        self.transfer_guard = (
            reliability.TransferIdGuard()
            if scheduler is not None
            and not scheduler.is_kv_consumer
            and self.sibling_ids
            else None
        )

    # -- scheduler side: sibling transfer ids, the transfer id guard ------------
    def _own_transfer_id(self, request: Any) -> None:
        """Give an n > 1 child or a batch's prompt its own transfer id
        (reliability.sibling_transfer_id), once, before upstream reads it."""
        params = request.kv_transfer_params
        if not self.sibling_ids or not params or not params.get("transfer_id"):
            return
        if SIBLING_BASE in params:
            return
        base = params["transfer_id"]
        own = reliability.sibling_transfer_id(
            base, request.request_id, randomized=self.randomized_ids
        )
        # A new dict: siblings may share the old one.
        request.kv_transfer_params = {**params, SIBLING_BASE: base, "transfer_id": own}

    def on_new_request(self, request: Any) -> None:
        self._own_transfer_id(request)
        super().on_new_request(request)

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        # Again here and in _finished (a no-op once done): a scheduler
        # without the on_new_request hook reaches upstream through these.
        self._own_transfer_id(request)
        guard = self.transfer_guard
        if guard is not None and not guard.admit(
            request.request_id, request.kv_transfer_params
        ):
            return
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(
            request,
            lambda: super(PDMooncakeConnector, self).request_finished(
                request, block_ids
            ),
        )

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(
            request,
            lambda: super(PDMooncakeConnector, self).request_finished_all_groups(
                request, block_ids
            ),
        )

    def _finished(
        self, request: Any, upstream_finished: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        self._own_transfer_id(request)
        guard = self.transfer_guard
        if guard is not None and guard.refuses(
            request.request_id, request.kv_transfer_params
        ):
            # Freed now; upstream would overwrite or cancel the owner's send.
            guard.finished(request.request_id, delayed=False)
            return False, None
        delayed, params = upstream_finished()
        if guard is not None:
            guard.finished(request.request_id, delayed)
        return delayed, params

    # -- worker side: the forward stream's KV-ready mark --------------------------
    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """The model runner binds before each step's forward, on the worker's
        main thread (its current stream is the forward's): the mark the
        staging copies wait on (device_copy.Ordering)."""
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None:
            self.connector_worker._mark_kv_ready()

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if self.transfer_guard is not None:
            self.transfer_guard.sent(connector_output.finished_sending or ())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return PDMooncakeStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ):
        return PDMooncakePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
