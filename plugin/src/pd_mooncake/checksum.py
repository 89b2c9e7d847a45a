"""Opt-in KV integrity check (``kv_connector_extra_config: {"kv_checksum": true}``).

Prefill digests, per registered region (each MLA latent layer, the draft's
GQA layer), exactly the block pages it sends for a request, in the order of
the request's block list; the digests travel to decode in the pull's answer
on the ZMQ side channel (``wire.XferResponse.pd_kv_digests``, a field upstream's
decoder ignores). Decode digests what landed in its own blocks when that
answer arrives, before the request is reported received; a mismatch goes
through upstream's failed-receive path (``_handle_failed_recv``: invalid
block ids, so vLLM's ``kv_load_failure_policy`` fails or recomputes the
request and the blocks never enter decode's prefix cache).

The digest, per region, over the request's blocks ``i`` (position in the
block list, not the block id: decode's ids differ from prefill's) and the
int32 words ``j`` of each block's page::

    s_i = sum_j W[j] * x[i, j]   (mod 2**32, read as a signed int32)
    D   = sum_i P[i] * s_i       (mod 2**64)

``W`` are fixed odd 32-bit constants, ``P`` fixed odd 64-bit ones
(splitmix64, the same on every host). ``kv_digest.SCHEME`` names this math
on the wire: a pull or an answer of another scheme (a peer running another
plugin version) is refused with both numbers, never compared. Why this one:

- speed: per region and chunk of about 2 MiB, a gather of the request's
  blocks (``index_select`` into a buffer reused for every chunk, no
  per-block Python loop), an in-place multiply and a per-block sum, all in
  int32 (AVX2 multiplies 32-bit lanes natively; 64-bit products are
  emulated, and widening the words to int64 first costs a copy), then one
  int64 multiply and sum over the per-block sums; in torch on the tensor's
  own device; only the regions' digests (8 bytes each) reach the host.
  2026-12-03, 1 thread, 152 MiB scattered in a 512 MiB cache: 0.13
  CPU-s/GiB, against 0.31 for the earlier form (scheme 1: 64-bit ``W``,
  ``sum_j`` modulo 2**64). Integer arithmetic modulo 2**32 and 2**64 is
  exact, so the result does not depend on the reduction order, the thread
  count or the device, which a floating-point sum would (the int32 sum is
  taken modulo 2**32 whatever torch accumulates in);
- what it catches: a changed word (``x -> x + d``, ``0 < |d| < 2**32``)
  changes ``s_i`` by ``W[j] d``, never 0 modulo 2**32 (``W[j]`` odd); that
  change, read as a signed difference, lies in (-2**32, 2**32) and is not
  0, so times an odd ``P[i]`` it is never 0 modulo 2**64: one changed word
  always changes ``D``. Zeros, a stale block, a block written to the wrong
  place and a partial write change many words: they go unseen only if the
  block's ``s_i`` collides, probability about 2**-32 (scheme 1: about
  2**-62); two blocks swapped change ``D`` by ``(P[i] - P[k]) (s_k -
  s_i)``, caught unless ``s_i == s_k``: the blocks are equal (then the swap
  is harmless) or, probability about 2**-32 (scheme 1: about 2**-62), their
  sums collide;
- what got weaker with 32-bit sums, and why that is acceptable: besides the
  2**-32 above, a change confined to bit ``b`` of several words moves
  ``s_i`` by multiples of ``2**b``, mixed by only ``32 - b`` bits of ``W``:
  an even number of flips of bit 31 in one block (two fp32 sign flips, the
  signs of two upper bf16 halves) cancels, always (tested, as the known
  miss). Transfer accidents (a lost, stale, misplaced or partly written
  block, a single bit flip) change low bits or one word, and are caught
  as above; mixing every bit (the top half weighted apart) measured 0.21
  CPU-s/GiB, most of the saving. Not a cryptographic hash: it catches
  accidents, not an adversary who can write decode's memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from pd_mooncake import metric_names, staging, wire

# The digest itself, without vLLM (scripts/gpu-datapath-check runs it where
# only PyTorch is installed); importable from here as before.
from pd_mooncake.kv_digest import (  # noqa: F401
    _MASK,
    CHUNK_BYTES,
    SCHEME,
    digest,
    position_weights,
    reference_digest,
    region_pages,
    word_weights,
)

logger = logging.getLogger("vllm.pd_mooncake")

KEY = "kv_checksum"
# Series (pd_mooncake.metric_names): counters (a scrape adds _total) with
# labels region and layout, and a 0/1 gauge.
MISMATCH = metric_names.CHECKSUM_MISMATCH
MATCH = metric_names.CHECKSUM_MATCH
ENABLED = metric_names.CHECKSUM_ENABLED
# Stats keys (PDMooncakeStats.data): lists of (region, layout).
MISMATCH_KEY = "kv_checksum_mismatch"
MATCH_KEY = "kv_checksum_match"
STATS_KEYS = (MATCH_KEY, MISMATCH_KEY)


# Prefill: digests of the requests of the send being built (computing while
# the bytes are on their way), until its answer is encoded (the same task:
# upstream's send_kv_to_decode awaits _build_transfer_params, sends, then
# encodes its answer).
_PENDING: contextvars.ContextVar[dict[str, Future] | None] = contextvars.ContextVar(
    "pd_kv_digests", default=None
)


# -- throughput (the report's figure; not run by the connector) ---------------
def measure_throughput(
    request_mib: int = 76, cache_mib: int = 512, page_bytes: int = 36864, rounds=5
) -> dict[str, float]:
    """GB/s of the digest over a request's scattered blocks (a 4096-token
    prompt on the twin is 76 MiB) in a cache larger than the CPU's caches,
    against a plain read (an int64 sum) and a copy of the same bytes."""
    words = page_bytes // 4
    blocks = cache_mib * 2**20 // page_bytes
    cache = torch.randint(-(2**31), 2**31 - 1, (blocks, words), dtype=torch.int32)
    n = request_mib * 2**20 // page_bytes
    ids = torch.randperm(cache.shape[0])[:n]
    gathered = cache.index_select(0, ids)
    nbytes = n * page_bytes

    def best(fn: Any) -> float:
        fn()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return nbytes / min(times) / 1e9

    return {
        "digest_GBps": best(lambda: digest(cache, ids)),
        "read_GBps": best(lambda: gathered.view(torch.int64).sum()),
        "copy_GBps": best(lambda: gathered.clone()),
        "gather_GBps": best(lambda: cache.index_select(0, ids)),
        "bytes": float(nbytes),
        "threads": float(torch.get_num_threads()),
    }


# -- the worker side -----------------------------------------------------------
class ChecksumWorker:
    """Mixed into the connector worker (before upstream's class)."""

    kv_checksum = False

    def _install_checksum(self, extra: Any) -> None:
        self.kv_checksum = bool(extra.get(KEY, False))
        if self.kv_checksum and self.kv_cache_config.has_mamba_layers:
            raise ValueError(
                f"kv_connector_extra_config[{KEY!r}]: not supported with Mamba "
                "layers (their state blocks are not pages)"
            )
        self._kv_pages: list[torch.Tensor] | None = None
        self._checksum_refused: set[str] = set()
        # One thread: digests of one send after another, beside the sends.
        self._digest_pool = ThreadPoolExecutor(1, "pd-kv-digest")
        encoder = wire.install(self)
        encoder.pull_fields.append(self._checksum_pull_fields)
        encoder.answer_fields.append(self._checksum_answer_fields)

    def _checksum_pull_fields(self) -> dict[str, Any]:
        if not self.kv_checksum:
            return {}
        return {"pd_kv_checksum": True, "pd_kv_digest_scheme": SCHEME}

    def _checksum_answer_fields(self, answer: Any) -> dict[str, Any]:
        """The digests of the answered requests (prefill)."""
        pending = _PENDING.get()
        if not pending or not answer.ok_reqs:
            return {}
        # Done long since, as a rule: the transfer takes longer.
        digests = {r: pending.pop(r).result() for r in answer.ok_reqs if r in pending}
        if not digests:
            return {}
        return {
            "pd_kv_digests": digests,
            "pd_kv_regions": list(self.registered_layer_names),
            "pd_kv_digest_scheme": SCHEME,
        }

    # both sides ---------------------------------------------------------------
    def _checksum_pages(self) -> list[torch.Tensor]:
        """Each registered region's pages as tensors (after registration;
        register_kv_caches builds them once, so a layout the digest cannot
        read fails start-up)."""
        if self._kv_pages is None:
            num_blocks = (
                self.kv_cache_config.num_blocks
                * self._physical_blocks_per_logical_kv_block
            )
            self._kv_pages = [
                region_pages(self.device_kv_caches, base, block, page, num_blocks)
                for base, block, page in zip(
                    self.kv_caches_base_addr,
                    self.block_len_per_layer,
                    self.kv_block_len_per_layer,
                    strict=True,
                )
            ]
        return self._kv_pages

    def _kv_digests(self, block_ids_by_group: list[list[int]]) -> list[int | None]:
        """Per registered region, the digest of these logical blocks (None
        where the region's group has none), read after the forward's KV
        writes and decode's scatter (staging_worker._kv_ordered: the staging
        stream, no device-wide wait)."""
        ordered = getattr(self, "_kv_ordered", contextlib.nullcontext)
        with ordered():
            return self._kv_digests_now(block_ids_by_group)

    def _kv_digests_now(self, block_ids_by_group: list[list[int]]) -> list[int | None]:
        kernel = self._logical_to_kernel_block_ids(block_ids_by_group)
        out: list[torch.Tensor | None] = []
        # One index tensor per group and device, shared by its regions.
        indexes: dict[tuple, torch.Tensor | None] = {}
        for pages, group, shared in zip(
            self._checksum_pages(),
            self.registered_group_indices,
            self.region_shared_groups,
            strict=True,
        ):
            key = (group, tuple(shared), pages.device)
            if key not in indexes:
                ids = upstream._block_ids_for_region(kernel, group, tuple(shared))
                indexes[key] = (
                    torch.tensor(ids, dtype=torch.long).to(pages.device)
                    if ids
                    else None
                )
            index = indexes[key]
            out.append(None if index is None else digest(pages, index))
        present = [d for d in out if d is not None]
        values = iter(torch.stack(present).tolist() if present else [])
        return [None if d is None else next(values) for d in out]

    # prefill ------------------------------------------------------------------
    def _checksum_refusal(self, meta: Any) -> str | None:
        wanted = bool(getattr(meta, "pd_kv_checksum", False))
        peer = f"{meta.remote_hostname}:{meta.remote_port}"
        if wanted != self.kv_checksum:
            reason = (
                f"{KEY} disagrees: prefill has {KEY}={self.kv_checksum}, decode "
                f"{peer} {KEY}={wanted}; set the same value in both roles' "
                "kv_connector_extra_config"
            )
        elif self.kv_checksum and (
            meta.remote_tp_size != self.tp_size
            or getattr(meta, "remote_pp_size", 1) != self.pp_size
        ):
            reason = (
                f"{KEY} needs the same TP and PP on both roles: prefill TP "
                f"{self.tp_size} PP {self.pp_size}, decode {peer} TP "
                f"{meta.remote_tp_size} PP {getattr(meta, 'remote_pp_size', 1)}"
            )
        elif (
            self.kv_checksum
            and (theirs := getattr(meta, "pd_kv_digest_scheme", 0)) != SCHEME
        ):
            # Compared, the digests would differ on every request.
            reason = (
                f"{KEY} digest schemes differ: prefill computes scheme {SCHEME}, "
                f"decode {peer} {_scheme(theirs)}; run the same pd_mooncake "
                "version on both roles"
            )
        else:
            return None
        return self._refused(peer, "pulls", reason)

    def _refused(self, peer: str, what: str, reason: str) -> str:
        """``reason``, logged the first time ``peer`` is refused."""
        if peer not in self._checksum_refused:
            self._checksum_refused.add(peer)
            logger.error("PD Mooncake: refusing %s from %s: %s", what, peer, reason)
        return reason

    async def _build_transfer_params(
        self,
        ready_reqs: list,
        agent_meta: Any,
        local_regions: list,
        remote_regions: list,
    ) -> tuple[list[int], list[int], list[int], list[str], str | None]:
        refusal = self._checksum_refusal(agent_meta)
        if refusal is not None:
            # Nothing is sent, now or later (a configuration matter): decode
            # fails these requests with the reason, and prefill frees their
            # blocks now, not at its abort timeout.
            for _, send_meta in ready_reqs:
                if self.reqs_need_send.pop(send_meta.transfer_id, None) is not None:
                    self.finished_sending_reqs.add(send_meta.p_req_id)
            return [], [], [], [d for d, _ in ready_reqs], refusal
        built = await super()._build_transfer_params(  # type: ignore[misc]
            ready_reqs, agent_meta, local_regions, remote_regions
        )
        if not self.kv_checksum:
            return built
        failed = set(built[3])
        # A request pulled in chunks (staging.Chunk): digested with its last,
        # over all its blocks, as decode verifies it once the last has landed.
        chunks = staging.CHUNKS.get() or {}
        sent = {
            d_req_id: _sent_blocks(
                meta.local_block_ids, agent_meta.req_blocks[d_req_id][1]
            )
            for d_req_id, meta in ready_reqs
            if d_req_id not in failed and chunks.get(d_req_id, [0, 0, 1])[-1]
        }
        # The bytes do not change while they are sent (prefill holds the
        # blocks until decode has them), so the digests are computed while
        # they travel, not before (the answer waits for them).
        _PENDING.set(
            {
                d_req_id: self._digest_pool.submit(self._kv_digests, ids)
                for d_req_id, ids in sent.items()
                if any(ids)
            }
        )
        return built

    # decode -------------------------------------------------------------------
    def _verify_kv_digests(self, response: Any, pull_metas: dict) -> None:
        """Before upstream reports ``response.ok_reqs`` received: take those
        whose KV does not match prefill's digests out of it and fail them."""
        if not self.kv_checksum or not response.ok_reqs:
            return
        sent = getattr(response, "pd_kv_digests", None) or {}
        names = getattr(response, "pd_kv_regions", None)
        theirs = getattr(response, "pd_kv_digest_scheme", 0)
        failed: dict[str, str] = {}
        for req_id in response.ok_reqs:
            meta = pull_metas.get(req_id)
            if meta is None or meta.failed or not any(meta.local_block_ids):
                continue
            expected = sent.get(req_id)
            if expected is None:
                failed[req_id] = (
                    f"prefill sent no KV digest ({KEY} off on prefill, or prefill "
                    "is not PDMooncakeConnector): set it on both roles"
                )
                continue
            if theirs != SCHEME:
                # Not compared: another scheme's digests differ on every
                # request, which is not a transfer fault.
                failed[req_id] = self._scheme_refusal(theirs, meta)
                continue
            reason = self._compare(req_id, expected, names, meta.local_block_ids)
            if reason:
                failed[req_id] = reason
        if failed:
            response.ok_reqs = [r for r in response.ok_reqs if r not in failed] or None
            for req_id, reason in failed.items():
                self._handle_failed_recv(pull_metas, [req_id], reason)

    def _scheme_refusal(self, theirs: int, meta: Any) -> str:
        peer = meta.remote_bootstrap_addr
        reason = (
            f"{KEY} digest schemes differ: prefill {peer} sent {_scheme(theirs)}"
            f" digests, decode computes scheme {SCHEME}; not compared: run the "
            "same pd_mooncake version on both roles"
        )
        return self._refused(peer, "KV digests", reason)

    def _compare(
        self, req_id: str, expected: list[int], names: Any, blocks: list[list[int]]
    ) -> str | None:
        mine = self.registered_layer_names
        if names != mine or len(expected) != len(mine):
            return f"KV checksum: prefill's regions {names} are not decode's {mine}"
        got = self._kv_digests(blocks)
        layouts = [r.layout for r in self.regions] or ["unknown"] * len(mine)
        bad = []
        for name, layout, want, have in zip(mine, layouts, expected, got, strict=True):
            if have is None:
                continue
            ok = have == want
            self.xfer_stats.record_checksum(name, layout, ok)
            if not ok:
                bad.append((name, layout, want, have))
        if not bad:
            return None
        name, layout, want, have = bad[0]
        logger.error(
            "PD Mooncake: KV checksum mismatch: request %s region %s (%s): prefill "
            "%s, decode %s (%d of %d regions differ)",
            req_id,
            name,
            layout,
            _hex(want),
            _hex(have),
            len(bad),
            sum(g is not None for g in got),
        )
        return f"KV checksum mismatch in {len(bad)} regions (first: {name})"


def _scheme(number: int) -> str:
    return (
        f"scheme {number}"
        if number
        else "no scheme (a plugin from before 2026-12-03: scheme 1)"
    )


def _hex(value: int | None) -> str:
    return "none" if value is None else f"{value & _MASK:#018x}"


def _sent_blocks(local: list[list[int]], remote: list[list[int]]) -> list[list[int]]:
    """Prefill's logical blocks that upstream sends into decode's ``remote``,
    in decode's order: per group the last ``len(remote)`` (a partial prefix
    hit on decode reads only the blocks it lacks; _build_transfer_params)."""
    if not any(remote):
        return []
    return [
        list(mine[-len(theirs) :]) if theirs else []
        for mine, theirs in zip(local, remote, strict=True)
    ]
