"""The connector worker's half of KV staging (pd_mooncake.staging): buffers,
decode's offers and scatter, prefill's gather. Mixed in before upstream's
worker class; ``connector.py`` calls it in one place per hook."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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
        counts = []
        for meta in pull_metas.values():
            kernel = self._logical_to_kernel_block_ids(meta.local_block_ids)
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

    async def _staging_offer(self, pull_metas: dict) -> staging.Offer | None:
        """A span for this pull's KV, waiting up to ``room_wait_s`` for one;
        None: staging off, or nothing to stage (a pull without blocks).
        Raises NoRoomError: the pull fails, it is never sent directly."""
        if self._arena is None or not pull_metas:
            return None
        need = self._staging_need(pull_metas)
        if not need:
            return None
        if need > self._arena.size:
            # Until a pull crosses staging in chunks (issue 26), one longer
            # than the whole buffer goes directly, as it always did: without
            # the late-write protection, said here. Failing it would refuse
            # most long-context traffic (Kimi-K2.5 over 3,776 tokens at the
            # default 256 MiB).
            logger.warning(
                "PD Mooncake: pull of %s takes %d bytes, over the %d of the KV "
                f"staging buffer ({staging.KEY}): pulled directly, without the "
                "late-write protection",
                list(pull_metas),
                need,
                self._arena.size,
            )
            return None
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

    def _staging_scatter(self, response: Any) -> None:
        """Before the answered requests are checked and reported received:
        their KV from the record the answer names into their blocks."""
        offer = staging.OFFER.get()
        if offer is None or self._kv_memory is None or self._staging_memory is None:
            return
        if getattr(response, "pd_staging_unsettled", False):
            offer.clean = False
        record = getattr(response, "pd_staging_record", None)
        if record is None or not response.ok_reqs:
            return  # prefill sent these directly
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

    def _staging_close(self, offer: staging.Offer | None, loaded: bool) -> None:
        """The pull is over: its span back, or held back if a write to it may
        still land."""
        if offer is None or self._arena is None:
            return
        hold = 0.0 if loaded and offer.clean else self.staging_hold.span_hold_s
        if hold:
            logger.warning(
                "PD Mooncake: KV staging span of %d bytes held back for %.0fs "
                "(its pull failed or prefill resent: a write may still land)",
                offer.nbytes,
                hold,
            )
        self._arena.release(offer.offset, offer.nbytes, hold)

    # prefill ------------------------------------------------------------------
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
    offer = staging.OFFER.get()
    return {"pd_staging": offer.wire} if offer is not None else {}


def _answer_fields(answer: Any) -> dict[str, Any]:
    """The record this answer's requests are in, and whether a write to the
    span may still land (prefill)."""
    target = staging.TARGET.get()
    if target is None:
        return {}
    fields: dict[str, Any] = {}
    if target.record is not None and answer.ok_reqs:
        fields["pd_staging_record"] = target.record
    target.record = None
    if target.unsettled:
        fields["pd_staging_unsettled"] = True
    return fields
