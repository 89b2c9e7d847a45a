"""Decode: a failed direct pull's KV blocks kept from reuse while a write to
them may still land (the invariant and its hold: ``late_writes``).

vLLM frees a failed load's blocks when the worker reports the request in
``finished_recving`` (vLLM 0.32 and 0.33, scheduler
``_update_from_kv_xfer_finished``: a finished request's blocks are freed
there; ``finish_requests`` leaves a request waiting for its KV allocated
until then). Upstream reports it with the failure (``_handle_failed_recv``);
the table below withholds that report until the hold has passed, while the
failure itself (invalid blocks or ``failed_recving``) goes at once, so the
client gets its error at once. A request the table holds is reported once,
and only after upstream reported it (0.33 reports a split pull's request
after its last peer settled: reporting it earlier would report it twice).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger("vllm.pd_mooncake")


@dataclass
class _Hold:
    until: float
    # Upstream reported the request finished (its report withheld here).
    reported: bool = False


class BlockHolds:
    """Request id -> when its blocks may go back to vLLM. Bounded: each
    entry is a request whose blocks vLLM keeps allocated, so there are never
    more than the KV cache has blocks (``limit``); an entry leaves once it is
    due and upstream reported it, and a table over the limit is logged (a
    request held without blocks: a leak to find, never one to hide by
    releasing early)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._holds: dict[str, _Hold] = {}

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._holds

    def hold(self, req_ids: Iterable[str], hold_s: float) -> None:
        """These requests' blocks may be written for ``hold_s`` from now: an
        entry's end only moves later (a split pull's other peers end later)."""
        until = time.monotonic() + hold_s
        for req_id in req_ids:
            entry = self._holds.setdefault(req_id, _Hold(until))
            entry.until = max(entry.until, until)
        if len(self._holds) > self.limit:
            logger.error(
                "PD Mooncake: %d requests' KV blocks held back for late writes, "
                "more than the KV cache's %d blocks could back: a hold leaks",
                len(self._holds),
                self.limit,
            )

    def filter(self, finished: set[str]) -> tuple[set[str], set[str]]:
        """Upstream's finished-receiving report, less the requests still held
        and with those now due: what the scheduler may free, and of it the
        requests this table held until now."""
        now = time.monotonic()
        out = set()
        released = set()
        for req_id in finished:
            if (entry := self._holds.get(req_id)) is None:
                out.add(req_id)
            else:
                entry.reported = True
        for req_id, entry in list(self._holds.items()):
            if entry.reported and entry.until <= now:
                del self._holds[req_id]
                out.add(req_id)
                released.add(req_id)
                logger.info(
                    "PD Mooncake: blocks of failed pull %s back to reuse: no "
                    "write to them can land any more",
                    req_id,
                )
        return out, released
