"""Decode's pull (worker side): upstream's, with a staging span offered
(pd_mooncake.staging), failed early when its prefill is gone
(pd_mooncake.reliability), requests counted once, and a failed direct
pull's blocks kept from reuse while a write may land (block_hold)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from pd_mooncake import block_hold, faults, geometry, reliability, staging

logger = logging.getLogger("vllm.pd_mooncake")

# Requests whose blocks a hold may keep at once when vLLM's cache config does
# not say how many blocks it has (block_hold.BlockHolds: a larger table is
# logged, never released early).
HELD_LIMIT = 1 << 16

# Set on an upstream PullReqMeta once its KV has fully arrived: the count it
# keeps (pull_tasks_count) is also 0 before a pull starts.
LOADED = "pd_loaded"


def _loaded(meta: Any) -> bool:
    return bool(getattr(meta, LOADED, False))


@dataclass
class _Settling:
    """The dict of a pull's requests upstream settles from, as upstream hands
    it to the overrides it calls (process_pulling_result, _handle_failed_recv).
    vLLM 0.32 settles the pull_metas it was given, by flags (``failed``, the
    count), and keeps every request in it. vLLM 0.33 settles a copy
    (mooncake_connector.py, MooncakeConnectorWorker.receive_kv_from_single_worker:
    ``pull_metas = pull_metas.copy()``, "each peer settles its own requests")
    and pops each request from it once this peer has settled it
    (process_pulling_result, _handle_failed_recv): only that copy says which
    requests this peer still owes, and settling one twice counts its
    pull_tasks_count down twice (_complete_pull_task)."""

    metas: dict | None = None


SETTLING: ContextVar[_Settling | None] = ContextVar("pd_settling", default=None)


def _settling_from(pull_metas: dict) -> None:
    if (settling := SETTLING.get()) is not None:
        settling.metas = pull_metas


class PullWorker:
    """Mixed into the connector worker (before upstream's class)."""

    liveness_interval_s: float = 0.0
    # Off where the fix cannot attach (fixes: failed_pull_block_hold).
    hold_failed_blocks: bool = True
    _block_holds: block_hold.BlockHolds | None = None

    @property
    def block_holds(self) -> block_hold.BlockHolds:
        if self._block_holds is None:
            config = getattr(self, "vllm_config", None)
            blocks = getattr(getattr(config, "cache_config", None), "num_gpu_blocks", 0)
            self._block_holds = block_hold.BlockHolds(blocks or HELD_LIMIT)
        return self._block_holds

    def _state_block_hold(self, vllm_config: Any) -> None:
        """Start-up, decode without staging: every pull is direct, and what a
        failed one costs (late_writes)."""
        policy = getattr(
            vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail"
        )
        hold_s = self.staging_hold.span_hold_s
        logger.info(
            "PD Mooncake: KV staging off: a failed pull keeps its KV blocks "
            "from reuse %.0fs (a late write may land; late_writes)%s",
            hold_s,
            f"; under kv_load_failure_policy {policy} its request waits that "
            "long before it is recomputed"
            if policy == "recompute"
            else "",
        )

    async def fetch_finished_recving_reqs(self) -> set[str]:
        """Upstream's report (get_finished runs it on the receiver loop, as
        every pull), less the failed direct pulls still held (block_hold)."""
        finished = await super().fetch_finished_recving_reqs()
        free, released = self.block_holds.filter(finished)
        if released:
            self.xfer_stats.record_block_holds(ended=len(released))
        return free

    async def receive_kv_from_single_worker(
        self, worker_addr: str, pull_metas: dict
    ) -> None:
        """Upstream's pull with a staging span offered (released, or held back
        if a write may still land, when the pull is over). With staging on, a
        pull that gets no span fails with the reason, unsent: never directly
        (late_writes). A pull longer than one span goes as pulls that each
        fit one (one after another), a request longer than one span alone
        in chunks (``_pull_chunked``)."""
        geometry.PEER.set(worker_addr)
        parts, long = self._staging_parts(pull_metas)
        for part in parts:
            await self._pull_staged(worker_addr, part)
        for req_id in long:
            await self._pull_chunked(worker_addr, {req_id: pull_metas[req_id]})

    async def _pull_staged(self, worker_addr: str, pull_metas: dict) -> None:
        """One pull through one span (or directly, staging off)."""
        try:
            offer = await self._staging_offer(pull_metas)
        except staging.NoRoomError as exc:
            pull_metas = self._fail_unstaged(pull_metas, exc)
            if not pull_metas:
                return
            offer = None
        await self._pull_through(worker_addr, pull_metas, offer)

    async def _pull_chunked(self, worker_addr: str, pull_metas: dict) -> None:
        """One request longer than one span, as sub-pulls of upstream's
        protocol, each of a run of its blocks (``staging.Chunk``, the pull's
        ``pd_chunk``) through a span of its own, one after another: each
        chunk's record is scattered into the blocks when its answer comes;
        the last settles the request (reported received, the checksum over
        all its blocks, prefill's send counted). A chunk that fails fails
        the request: the rest are not pulled, its span is held back."""
        ((req_id, meta),) = pull_metas.items()
        try:
            chunks = self._staging_chunks(req_id, meta.local_block_ids)
        except staging.NoRoomError as exc:
            self._fail_unstaged(pull_metas, exc)
            return
        whole = self._whole_groups(len(meta.local_block_ids))
        for chunk in chunks:
            blocks = self._chunk_blocks(meta.local_block_ids, chunk, whole)
            try:
                offer = await self._staging_room(self._groups_need([blocks]))
            except staging.NoRoomError as exc:
                self._fail_unstaged(pull_metas, exc)
                return
            await self._pull_through(worker_addr, pull_metas, offer, chunk)
            if meta.failed or chunk.last:
                return
            if req_id not in offer.answered:
                # Answered without naming it (an error upstream did not name
                # the request in): the next chunk would leave a gap.
                self._handle_failed_recv(
                    dict(pull_metas),
                    [req_id],
                    f"KV staging: no answer for blocks {chunk.start}-{chunk.stop} "
                    "from prefill",
                )
                return

    async def _pull_through(
        self,
        worker_addr: str,
        pull_metas: dict,
        offer: staging.Offer | None,
        chunk: staging.Chunk | None = None,
    ) -> None:
        """Upstream's pull (kept alive: ``_pull_while_alive``) with ``offer``
        as its span and ``chunk`` as its run of blocks; then the span back or
        held (``_staging_close``), or without a span the failed requests'
        blocks held from the pull's end."""
        offer_token = staging.OFFER.set(offer)
        chunk_token = staging.CHUNK.set(chunk)
        settling = SETTLING.set(_Settling())
        try:
            await self._pull_while_alive(worker_addr, pull_metas)
        finally:
            SETTLING.reset(settling)
            staging.CHUNK.reset(chunk_token)
            staging.OFFER.reset(offer_token)
            self._staging_close(offer, pull_metas)
            if offer is None:
                # The hold runs from the pull's end (late_writes): a request
                # failed while this peer's pull still ran, or failed by
                # another peer of a split pull, is held from this end too.
                held = [r for r in pull_metas if r in self.block_holds]
                self.block_holds.hold(held, self.staging_hold.span_hold_s)

    def _fail_unstaged(self, pull_metas: dict, exc: Exception) -> dict:
        """A pull staging cannot take: its requests with blocks fail, unsent.
        The rest (a rejected request's release notice has no blocks: nothing
        is written) still go, without a span: prefill frees its blocks on
        that notice, not at its abort timeout. Returns the rest."""
        rest = {r: m for r, m in pull_metas.items() if not self._staging_need({r: m})}
        failing = [r for r, m in pull_metas.items() if r not in rest and not _loaded(m)]
        logger.warning("PD Mooncake: pull of %s failed: %s", failing, exc)
        # A copy, as _pull_while_alive's: vLLM 0.33 pops each request it
        # settles from the dict it is given, and this one other peers share.
        self._handle_failed_recv(dict(pull_metas), failing, str(exc))
        return rest

    async def _pull_while_alive(self, worker_addr: str, pull_metas: dict) -> None:
        """Upstream's pull, failed early if its prefill is gone (reliability):
        upstream would wait ABORT_REQUEST_TIMEOUT + 60 s for an answer."""
        interval = self.liveness_interval_s
        upstream_pull = super().receive_kv_from_single_worker(worker_addr, pull_metas)
        if not interval or not pull_metas:
            await upstream_pull
            return
        first = next(iter(pull_metas.values()))
        bootstrap, engine_id = first.remote_bootstrap_addr, first.remote_engine_id
        pull = asyncio.ensure_future(upstream_pull)
        gone_in_a_row = 0
        wait_s = interval
        while True:
            done, _ = await asyncio.wait({pull}, timeout=wait_s)
            if done:
                pull.result()
                return
            probed = time.monotonic()
            # A silent host takes the probe's whole timeout to answer; the
            # next wait is shortened by it, so a silent prefill is failed as
            # soon as a refusing one (REFUSALS_TO_FAIL probes, one interval
            # apart).
            reason, moved = await reliability.probe_pull(
                bootstrap, engine_id, worker_addr, min(1.0, interval / 2)
            )
            if moved:
                # Proof at once: the next pull asks the bootstrap server anew.
                self._remote_agents.pop(engine_id, None)
                break
            wait_s = max(0.0, interval - (time.monotonic() - probed))
            gone_in_a_row = gone_in_a_row + 1 if reason else 0
            if gone_in_a_row >= reliability.REFUSALS_TO_FAIL:
                break
        pull.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pull
        # Only what this peer still owes, from the dict upstream settles
        # from (_Settling; a private copy if upstream settled nothing yet, so
        # that 0.33's pops never touch the pull_metas other peers share): a
        # request an earlier CONTINUE completed is already loaded and
        # reported finished, one upstream already failed is failed once.
        settling = SETTLING.get()
        owed = settling.metas if settling is not None else None
        if owed is None:
            owed = dict(pull_metas)
        self._handle_failed_recv(
            owed,
            [r for r, m in owed.items() if not _loaded(m)],
            f"prefill gone or moved: its bootstrap server {bootstrap} {reason}",
        )

    def _handle_failed_recv(self, pull_metas: dict, req_ids: Any, reason: str) -> None:
        # Upstream reports every id it is given (mooncake_connector.py
        # _handle_failed_recv), and its pull hands it the whole pull on an
        # error or a socket timeout, even after a CONTINUE completed some:
        # their blocks would be reported invalid and they finished a second
        # time, which fails or recomputes a correct load, or trips the
        # scheduler's `assert req_id in self.requests` once it moved on.
        _settling_from(pull_metas)
        outstanding = [r for r in req_ids if not _loaded(pull_metas.get(r))]
        if (offer := staging.OFFER.get()) is not None:
            offer.clean = False
        elif SETTLING.get() is not None and self.hold_failed_blocks:
            self._hold_blocks(pull_metas, outstanding)
        super()._handle_failed_recv(pull_metas, outstanding, reason)

    def _hold_blocks(self, pull_metas: dict, req_ids: list) -> None:
        """A direct pull (no staging span) failed after decode asked prefill
        for it: prefill may have submitted writes into these requests' blocks,
        which land up to the hold after the pull's end (late_writes). vLLM
        keeps the blocks allocated until the worker reports the request
        finished receiving (block_hold); that report waits for the hold."""
        held = [
            r
            for r in req_ids
            if (meta := pull_metas.get(r)) is not None
            and not meta.failed
            and any(meta.local_block_ids)
        ]
        if not held:
            return
        hold_s = self.staging_hold.span_hold_s
        self.block_holds.hold(held, hold_s)
        self.xfer_stats.record_block_holds(started=len(held))
        logger.warning(
            "PD Mooncake: KV blocks of failed direct pull %s held back %.0fs "
            "(a write prefill submitted may still land; %d requests held)",
            held,
            hold_s,
            len(self.block_holds),
        )

    def process_pulling_result(self, response: Any, pull_metas: dict) -> None:
        _settling_from(pull_metas)
        self._geometry_answered(response)
        try:
            self._staging_scatter(response, pull_metas)
        except ValueError as exc:
            failed, response.ok_reqs = response.ok_reqs, None
            self._handle_failed_recv(pull_metas, failed, str(exc))
        chunk = staging.CHUNK.get()
        if chunk is not None and not chunk.last:
            # Its blocks are in place (the scatter); the request is not loaded
            # before its last chunk: nothing to settle or verify yet.
            response.ok_reqs = None
        fault = faults.active_fault()
        if fault == faults.CORRUPT_RECEIVED_KV:
            self._corrupt(response, pull_metas)
        # After the fault: the check must see what decode will compute with.
        self._verify_kv_digests(response, pull_metas)
        if fault == faults.CORRUPT_CHECKED_KV:
            self._corrupt(response, pull_metas)
        if fault == faults.LOSE_DRAFT_KV:
            self._corrupt(response, pull_metas, draft_only=True)
        # Looked up before upstream settles them: 0.33 pops each from its copy
        # of pull_metas (_Settling). The copy is shallow (dict.copy()): the
        # PullReqMeta objects, and so the marker, are the ones every peer's
        # pull and the wrapper's staging close read.
        answered = [pull_metas.get(r) for r in response.ok_reqs or ()]
        super().process_pulling_result(response, pull_metas)
        for meta in answered:
            # Upstream reports a request finished when its last worker's part
            # arrives (pull_tasks_count 0), unless it failed first.
            if meta is not None and not meta.failed and meta.pull_tasks_count <= 0:
                setattr(meta, LOADED, True)
