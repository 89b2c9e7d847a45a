"""The connector worker's half of KV staging (pd_mooncake.staging): buffers,
decode's offers and scatter, prefill's gather. Mixed in before upstream's
worker class; ``connector.py`` calls it in one place per hook."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from pd_mooncake import device_copy, late_writes, staging, wire

logger = logging.getLogger("vllm.pd_mooncake")


@dataclass
class Staged:
    """One send as prefill writes it: the record's descriptors, and the
    prefill span they are read from (released once the write has settled)."""

    src: list[int]
    dst: list[int]
    lengths: list[int]
    offset: int
    nbytes: int
    target: staging.Target
    # Its offset in decode's span.
    record: int


# Between looks for room in a staging buffer: short against a pull, long
# against a look (a lock and a scan of a few free spans).
ROOM_POLL_S = 0.01


class StagingWorker:
    staging_bytes = 0
    _arena: staging.Arena | None = None
    # Decode's timeouts of the late-write rule (late_writes); read from the
    # environment where the worker was not installed (tests).
    _hold: late_writes.DecodeHold | None = None
    # The KV caches and the staging buffer, apart: decode copies only from the
    # buffer into the caches, prefill only the other way.
    _kv_memory: staging.Memory | None = None
    _staging_memory: staging.Memory | None = None
    # The staging stream and the forward stream's KV-ready mark (device_copy).
    _ordering: device_copy.Ordering | None = None
    # Decode: the most bytes one pull's span takes (None: the whole buffer); a
    # longer request is pulled in chunks (a test's hook, to chunk small pulls).
    chunk_bytes: int | None = None

    def _install_staging(self, extra: Any) -> None:
        self.staging_bytes = int(extra.get(staging.KEY, 0)) << 20
        # Also without staging: a failed direct pull's blocks are held as
        # long as a span (pull.PullWorker._hold_blocks).
        self._hold = late_writes.DecodeHold.from_env(os.environ)
        if self.staging_bytes:
            # Start-up: a wait for room too long is refused here.
            self._hold.check()
        encoder = wire.install(self)
        encoder.pull_fields.append(_offer_fields)
        encoder.answer_fields.append(_answer_fields)

    def _register_staging(self) -> None:
        """After the KV caches: the staging buffer, registered with Mooncake
        like them, where ``staging_home`` says."""
        tensors = list(getattr(self, "device_kv_caches", {}).values())
        if not tensors:
            return
        device = tensors[0].device
        # Also without a buffer: the checksum's digests use the ordering.
        self._ordering = device_copy.Ordering(device)
        if not self.staging_bytes:
            return
        home = device_copy.staging_home(getattr(self, "protocol", "rdma"), device)
        # Zeroed now: the first transfers through a span would otherwise pay
        # for the kernel mapping its pages in.
        buffer = torch.zeros(
            self.staging_bytes,
            dtype=torch.uint8,
            device=home,
            pin_memory=home.type == "cpu" and device.type == "cuda",
        )
        if self.engine.register_memory(buffer.data_ptr(), buffer.numel()) != 0:
            raise RuntimeError(
                f"PD Mooncake: registering the {self.staging_bytes >> 20} MiB KV "
                f"staging buffer failed; set {staging.KEY}: 0 to run without it"
            )
        self._arena = staging.Arena(buffer)
        self._kv_memory = staging.Memory(tensors)
        self._staging_memory = staging.Memory([buffer])
        logger.info(
            "PD Mooncake: KV staging buffer %d MiB on %s%s",
            self.staging_bytes >> 20,
            buffer.device,
            " (pinned)" if buffer.is_pinned() else "",
        )
        if home.type == "cuda":
            # Allocated after vLLM sized its KV cache from
            # gpu_memory_utilization: outside its budget (docs/gpu.md).
            logger.warning(
                "PD Mooncake: the %d MiB KV staging buffer is device memory "
                "outside vLLM's gpu_memory_utilization; leave that much free "
                "(docs/gpu.md, 'KV staging memory')",
                self.staging_bytes >> 20,
            )

    def _mark_kv_ready(self) -> None:
        """The worker's main thread, before each step's forward is enqueued
        (connector.bind_connector_metadata): see device_copy.Ordering."""
        if self._ordering is not None:
            self._ordering.mark_kv_ready()

    def _kv_ordered(self) -> contextlib.AbstractContextManager[Any]:
        """Reads and writes of KV memory from a connector thread, ordered after
        the forward's KV writes (the checksum's digests use it too)."""
        if self._ordering is None:
            return contextlib.nullcontext()
        return self._ordering.staged()

    # decode -------------------------------------------------------------------
    @property
    def staging_hold(self) -> late_writes.DecodeHold:
        if self._hold is None:
            self._hold = late_writes.DecodeHold.from_env(os.environ)
        return self._hold

    def _staging_need(self, pull_metas: dict) -> int:
        """Span bytes this pull's KV takes (0: nothing to stage)."""
        return self._groups_need([m.local_block_ids for m in pull_metas.values()])

    def _groups_need(self, requests: list[list[list[int]]]) -> int:
        """Span bytes these requests' blocks (one list per KV cache group
        each) take."""
        counts = []
        for groups in requests:
            kernel = self._logical_to_kernel_block_ids(groups)
            counts.append(max((len(g) for g in kernel), default=0))
        if not any(counts):
            return 0
        return staging.span_bound(counts, self.block_len_per_layer)

    def _staging_reserve(self, pull_metas: dict) -> staging.Offer | None:
        """A span for this pull's KV now, or None (no room now). Staging must
        be on and the pull have blocks."""
        return self._staging_span(self._staging_need(pull_metas))

    def _staging_span(self, nbytes: int) -> staging.Offer | None:
        assert self._arena is not None
        offset = self._arena.reserve(nbytes)
        if offset is None:
            return None
        return staging.Offer(offset, nbytes, self._arena.base + offset)

    @property
    def chunk_bound(self) -> int:
        """The most bytes one pull's span takes: the whole buffer, or less
        where ``chunk_bytes`` says (a test's hook)."""
        assert self._arena is not None
        return min(self.chunk_bytes or self._arena.size, self._arena.size)

    def _staging_parts(self, pull_metas: dict) -> tuple[list[dict], list[str]]:
        """A pull as pulls that each fit one span (whole requests in their
        order; one without blocks rides in the current one), and the
        requests that do not fit one alone (pulled in chunks:
        ``_staging_chunks``). A pull that fits, or with staging off: itself,
        unchanged."""
        if self._arena is None or not pull_metas:
            return [pull_metas], []
        bound = self.chunk_bound
        if self._staging_need(pull_metas) <= bound:
            return [pull_metas], []
        parts: list[dict] = [{}]
        long: list[str] = []
        room = bound
        for req_id, meta in pull_metas.items():
            need = self._staging_need({req_id: meta})
            if need > bound:
                long.append(req_id)
                continue
            if need > room:
                parts.append({})
                room = bound
            parts[-1][req_id] = meta
            room -= need
        return [p for p in parts if p], long

    def _whole_groups(self, count: int) -> list[bool]:
        """Per KV cache group of a request, whether its chunks carry it
        entire (in the last): Mamba's state blocks are no pages in token
        order, and upstream filters their placeholders before pairing."""
        config = getattr(self, "kv_cache_config", None)
        groups = getattr(config, "transfer_groups", None)
        mamba = getattr(upstream, "MambaSpec", None)
        if not groups or mamba is None or len(groups) != count:
            return [False] * count
        return [isinstance(g.kv_cache_spec, mamba) for g in groups]

    def _staging_chunks(self, req_id: str, groups: list[list[int]]) -> list:
        """A request too long for one span as chunks that each fit one:
        runs of its block positions (logical blocks, each ``ratio`` kernel
        blocks). Raises NoRoomError where not even one block fits."""
        bound = self.chunk_bound
        whole = self._whole_groups(len(groups))
        positions = max(
            (len(g) for g, entire in zip(groups, whole, strict=True) if not entire),
            default=0,
        )
        ratio = int(getattr(self, "_physical_blocks_per_logical_kv_block", 1))
        per_chunk = staging.chunk_blocks(bound, self.block_len_per_layer) // ratio
        chunks = [
            staging.Chunk(req_id, start, stop, stop == positions)
            for start, stop in staging.chunk_ranges(positions, max(per_chunk, 1))
        ] or [staging.Chunk(req_id, 0, 0, True)]
        for chunk in chunks:
            need = self._groups_need([self._chunk_blocks(groups, chunk, whole)])
            if need > bound:
                raise staging.NoRoomError(
                    f"KV staging: a chunk of {chunk.stop - chunk.start} blocks "
                    f"takes {need} bytes, over the {bound} of a span "
                    f"({staging.KEY}); not sent directly (late_writes)"
                )
        return chunks

    @staticmethod
    def _chunk_blocks(
        groups: list[list[int]], chunk: staging.Chunk, whole: list[bool]
    ) -> list[list[int]]:
        return staging.chunk_groups(groups, chunk.start, chunk.stop, chunk.last, whole)

    async def _staging_offer(self, pull_metas: dict) -> staging.Offer | None:
        """A span for this pull's KV, waiting up to ``room_wait_s`` for one;
        None: staging off, or nothing to stage (a pull without blocks).
        Raises NoRoomError: the pull fails, it is never sent directly."""
        if self._arena is None or not pull_metas:
            return None
        need = self._staging_need(pull_metas)
        if not need:
            return None
        return await self._staging_room(need)

    async def _staging_room(self, need: int) -> staging.Offer:
        """A span of ``need`` bytes, waiting up to ``room_wait_s`` for one.
        Raises NoRoomError (a need over the whole buffer at once: pulls are
        split to fit it, ``_staging_parts``)."""
        assert self._arena is not None
        if need > self._arena.size:
            raise staging.NoRoomError(
                f"KV staging: a pull of {need} bytes exceeds the "
                f"{self._arena.size}-byte staging buffer ({staging.KEY}); not "
                "sent directly (late_writes)"
            )
        wait_s = self.staging_hold.room_wait_s
        start = time.monotonic()
        # The need once: the poll below runs every ROOM_POLL_S.
        while (offer := self._staging_span(need)) is None:
            if time.monotonic() - start >= wait_s:
                raise staging.NoRoomError(
                    f"KV staging: no room for this pull's "
                    f"{need} bytes in {wait_s:g} s "
                    f"({self._arena.held()} of {self._arena.size} bytes held back "
                    "for late writes); not sent directly (late_writes)"
                )
            await asyncio.sleep(ROOM_POLL_S)
        if (waited := time.monotonic() - start) > ROOM_POLL_S:
            logger.info("PD Mooncake: a pull waited %.2fs for staging room", waited)
        return offer

    def _staging_scatter(self, response: Any, pull_metas: dict) -> None:
        """Before the answered requests are checked and reported received:
        their KV from the record the answer names into their blocks, and
        the requests noted answered on the offer. Raises ValueError (the
        answered requests fail) where the record cannot be trusted or must
        not land: none at all (prefill wrote directly), or a request of it
        already failed by another peer of a split pull (its blocks may be
        another request's by now)."""
        offer = staging.OFFER.get()
        if offer is None or self._kv_memory is None or self._staging_memory is None:
            return
        if getattr(response, "pd_staging_unsettled", False):
            offer.clean = False
        if not response.ok_reqs:
            return
        record = getattr(response, "pd_staging_record", None)
        if record is None:
            if not getattr(response, "pd_staging_empty", False):
                raise ValueError(
                    "KV staging: prefill answered a staged pull with no record: "
                    "it wrote into the KV blocks directly, without the "
                    f"late-write protection (its {staging.KEY} is 0, or it is "
                    f"not PDMooncakeConnector); set {staging.KEY} alike on both "
                    "roles"
                )
            offer.answered.update(response.ok_reqs)
            return
        answered = [pull_metas.get(r) for r in response.ok_reqs]
        if gone := [m.d_req_id for m in answered if m is not None and m.failed]:
            raise ValueError(
                f"KV staging: record not scattered: {gone} already failed (by "
                "another prefill worker of this pull) and their blocks may be "
                "reused"
            )
        buffer = self._staging_memory
        start = time.monotonic()
        at = offer.address + record
        with self._kv_ordered():
            head = buffer.read_words(at, staging.HEAD_WORDS)
            magic, nonce, count = (int(w) for w in head)
            if magic != staging.MAGIC or nonce != offer.nonce:
                raise ValueError(
                    "KV staging: no record of this pull where the answer says"
                )
            table = buffer.read_words(at + 8 * staging.HEAD_WORDS, 2 * count)
            dsts, lengths = table[:count].tolist(), table[count:].tolist()
            size = staging.record_bytes(lengths)
            if record + size > offer.nbytes:
                raise ValueError(f"KV staging: a {size}-byte record overruns the span")
            data = at + staging.head_bytes(count)
            srcs = [data + o for o in staging.offsets(lengths)]
            device_copy.move(self._kv_memory, dsts, buffer, srcs, lengths)
        # The host waited for the scatter (only): the checksum and the next
        # forward read these blocks.
        self.xfer_stats.record_staging("scatter", time.monotonic() - start)
        offer.answered.update(response.ok_reqs)

    def _staging_close(self, offer: staging.Offer | None, pull_metas: dict) -> None:
        """This peer's pull is over: its span back, or held back if a write
        to it may still land: the pull failed, prefill resent, or a request
        with blocks got no answer from this peer (a split pull's other peers
        do not count: each writes only into its own span)."""
        if offer is None or self._arena is None:
            return
        owed = [r for r, m in pull_metas.items() if any(m.local_block_ids)]
        settled = offer.clean and offer.answered.issuperset(owed)
        hold = 0.0 if settled else self.staging_hold.span_hold_s
        if hold:
            logger.warning(
                "PD Mooncake: KV staging span of %d bytes held back for %.0fs "
                "(its pull failed, was unanswered or prefill resent: a write "
                "may still land)",
                offer.nbytes,
                hold,
            )
        self._arena.release(offer.offset, offer.nbytes, hold)

    # prefill ------------------------------------------------------------------
    _staging_refused = False

    def _staging_refusal(self, meta: Any) -> str | None:
        """Why this prefill refuses a pull (None: it proceeds): decode offered
        a span and staging is off here, so the send would go into decode's
        KV blocks directly, without the late-write protection decode relies
        on (late_writes). Logged once."""
        if getattr(meta, "pd_staging", None) is None or self._arena is not None:
            return None
        reason = (
            f"KV staging: decode offered a staging span and this prefill's "
            f"{staging.KEY} is 0: it would write into decode's KV blocks "
            f"directly, without the late-write protection; set {staging.KEY} "
            "alike on both roles (configs/vllm)"
        )
        if not self._staging_refused:
            self._staging_refused = True
            logger.error("PD Mooncake: refusing pulls: %s", reason)
        return reason

    async def _build_transfer_params(
        self,
        ready_reqs: list,
        agent_meta: Any,
        local_regions: list,
        remote_regions: list,
    ) -> tuple[list[int], list[int], list[int], list[str], str | None]:
        """Upstream's, for a chunked pull (``staging.CHUNKS``) of only each
        chunk's blocks. A chunk before the last is not the request's send:
        upstream counts each answered send (``sent``) and frees the request
        at ``need_send``, so each such chunk adds one to ``need_send``, and
        gives the request a new abort timeout (a pull in progress)."""
        chunks = staging.CHUNKS.get()
        if not chunks:
            return await super()._build_transfer_params(  # type: ignore[misc]
                ready_reqs, agent_meta, local_regions, remote_regions
            )
        req_blocks = dict(agent_meta.req_blocks)
        ready = []
        for d_req_id, send_meta in ready_reqs:
            wire_chunk, entry = chunks.get(d_req_id), req_blocks.get(d_req_id)
            sliced = (
                self._chunk_of(send_meta.local_block_ids, entry[1], wire_chunk)
                if wire_chunk is not None and entry is not None
                else None
            )
            if sliced is None:
                # Upstream reports a mismatch as it does for any pull.
                ready.append((d_req_id, send_meta))
                continue
            local, remote = sliced
            req_blocks[d_req_id] = (entry[0], remote)
            mine = dataclasses.replace(send_meta, local_block_ids=local)
            ready.append((d_req_id, mine))
            if not wire_chunk[2]:
                self._chunk_not_the_send(send_meta)
        return await super()._build_transfer_params(  # type: ignore[misc]
            ready,
            msgspec.structs.replace(agent_meta, req_blocks=req_blocks),
            local_regions,
            remote_regions,
        )

    @staticmethod
    def _chunk_not_the_send(send_meta: Any) -> None:
        """A chunk before the last: upstream will count its answer in
        ``sent`` and free the request at ``need_send``, so one more is
        needed; and the request's abort timeout starts again (its pull is
        in progress, its next chunk not yet asked for)."""
        send_meta.need_send += 1
        send_meta.expire_time = max(
            send_meta.expire_time, time.perf_counter() + _abort_timeout_s()
        )

    def _chunk_of(
        self, local: list[list[int]], remote: list[list[int]], wire_chunk: list[int]
    ) -> tuple[list[list[int]], list[list[int]]] | None:
        """Prefill's and decode's blocks of one chunk (None: the lists do not
        pair, upstream reports it). Positions count from the first block
        decode asked for: upstream reads prefill's last ``len(remote)``
        blocks of each group (a partial prefix hit on decode)."""
        if len(wire_chunk) != 3 or len(local) != len(remote):
            return None
        pairs = zip(local, remote, strict=True)
        if any(len(mine) < len(theirs) for mine, theirs in pairs):
            return None
        start, stop, last = int(wire_chunk[0]), int(wire_chunk[1]), bool(wire_chunk[2])
        whole = self._whole_groups(len(remote))
        paired = [
            # Mamba groups go as they are (upstream pairs them itself).
            list(mine) if entire else list(mine[-len(theirs) :]) if theirs else []
            for mine, theirs, entire in zip(local, remote, whole, strict=True)
        ]
        return (
            staging.chunk_groups(paired, start, stop, last, whole),
            staging.chunk_groups(remote, start, stop, last, whole),
        )

    def _stage_send(
        self,
        src: list[int],
        dst: list[int],
        lengths: list[int],
        may_wait: Callable[[float], bool] = lambda now: False,
    ) -> Staged | None:
        """This send as one record into decode's span; None (direct) only
        when decode offered none or staging is off here. Raises NoRoomError when
        the record does not fit the span's rest, or prefill's buffer has no
        room for it while ``may_wait(now)`` (and ``room_wait_s``) allows."""
        target = staging.TARGET.get()
        kv, buffer = self._kv_memory, self._staging_memory
        if target is not None:
            target.sent = True
        if target is None or self._arena is None or kv is None or buffer is None:
            return None
        size = staging.record_bytes(lengths)
        if target.cursor + size > target.nbytes:
            raise staging.NoRoomError(
                f"KV staging: a {size}-byte record does not fit the "
                f"{target.nbytes - target.cursor} bytes left of decode's span; "
                "not sent directly (late_writes)"
            )
        if size > self._arena.size:
            raise staging.NoRoomError(
                f"KV staging: a {size}-byte record exceeds prefill's staging "
                f"buffer ({self._arena.size} bytes, {staging.KEY}); not sent "
                "directly (late_writes)"
            )
        waited = time.monotonic()
        while (offset := self._arena.reserve(size)) is None:
            now = time.monotonic()
            if now - waited >= self.staging_hold.room_wait_s or not may_wait(now):
                raise staging.NoRoomError(
                    f"KV staging: no room for a {size}-byte record in prefill's "
                    f"staging buffer after {now - waited:.1f} s; not sent "
                    "directly (late_writes)"
                )
            time.sleep(ROOM_POLL_S)
        start = time.monotonic()
        at = self._arena.base + offset
        head = staging.header(target.nonce, dst, lengths)
        try:
            # The gather waits for the forward's KV writes (a mark), and the
            # host for the gather: Mooncake reads the buffer outside streams.
            with self._kv_ordered():
                buffer.write_words(at, head)
                data = at + head.nbytes
                device_copy.move(
                    buffer,
                    [data + o for o in staging.offsets(lengths)],
                    kv,
                    src,
                    lengths,
                )
        except ValueError:
            self._arena.release(offset, size)
            raise
        self.xfer_stats.record_staging("gather", time.monotonic() - start)
        record, target.cursor = target.cursor, target.cursor + staging.aligned(size)
        c_src, c_dst, c_len = staging.chunks(at, target.address + record, size)
        return Staged(c_src, c_dst, c_len, offset, size, target, record)

    def _staged_sent(
        self, staged: Staged | None, ok: bool, resends: int, seconds: float
    ) -> None:
        if staged is None or self._arena is None:
            return
        # The write waited for its submissions (stall_guard.write); one that
        # Mooncake still ran past its attempt timeout may read this span;
        # reused, its late write carries other bytes, but into decode's span,
        # which the answer tells decode to hold back.
        self._arena.release(staged.offset, staged.nbytes)
        self.xfer_stats.record_staging("write", seconds)
        if ok:
            staged.target.record = staged.record
        if resends or not ok:
            staged.target.unsettled = True


def _offer_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if (offer := staging.OFFER.get()) is not None:
        fields["pd_staging"] = offer.wire
    if (chunk := staging.CHUNK.get()) is not None:
        fields["pd_chunk"] = chunk.wire
    return fields


def _abort_timeout_s() -> float:
    """Prefill's wait for a pull after the request finished (upstream's
    expiry, VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT)."""
    from vllm import envs

    return float(envs.VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT)


def _answer_fields(answer: Any) -> dict[str, Any]:
    """The record this answer's requests are in (or that this worker sent
    nothing of them), and whether a write to the span may still land
    (prefill)."""
    target = staging.TARGET.get()
    if target is None:
        return {}
    fields: dict[str, Any] = {}
    if target.record is not None and answer.ok_reqs:
        fields["pd_staging_record"] = target.record
    elif answer.ok_reqs and not target.sent:
        # No send for these (upstream's send_kv_to_decode sends only when
        # its plan has descriptors): decode must tell this from a prefill
        # that ignored its span and wrote directly.
        fields["pd_staging_empty"] = True
    target.record, target.sent = None, False
    if target.unsettled:
        fields["pd_staging_unsettled"] = True
    return fields
