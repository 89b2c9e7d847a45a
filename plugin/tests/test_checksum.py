"""The opt-in KV checksum (pd_mooncake.checksum): the digest on real tensors
catches each failure that matters, and between two real Mooncake engines a
corrupted receive is failed through upstream's failed-receive path while an
intact one is reported received.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from test_transfer import (
    DEADLINE_S,
    DECODE_BLOCKS,
    PREFILL_BLOCKS,
    SHAPES,
    connector_worker,
)
from test_transfer import pull_metadata as worker_pull
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from conftest import make_worker
from pd_mooncake import checksum, extra_config, faults, kv_digest, wire

BLOCKS, TOKENS, LATENT = 64, 16, 96
PAGE = TOKENS * LATENT * 4
IDS = [5, 9, 2, 40, 17]


def pages_of(cache: torch.Tensor) -> torch.Tensor:
    return checksum.region_pages(
        {"c": cache}, cache.data_ptr(), PAGE, PAGE, cache.shape[0]
    )


def request_digest(cache: torch.Tensor, ids: list[int]) -> int:
    return int(checksum.digest(pages_of(cache), torch.tensor(ids)))


@pytest.fixture
def sent() -> torch.Tensor:
    return torch.randn(
        BLOCKS, TOKENS, LATENT, generator=torch.Generator().manual_seed(3)
    )


def landed(sent: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Decode's cache holding the request's blocks at other ids, and its ids;
    the other blocks hold other (stale) KV."""
    cache = torch.randn(
        BLOCKS, TOKENS, LATENT, generator=torch.Generator().manual_seed(4)
    )
    mine = [(b * 7 + 3) % BLOCKS for b in ids]
    cache[mine] = sent[ids]
    return cache, mine


def test_digest_is_the_documented_sum(sent: torch.Tensor) -> None:
    rows = pages_of(sent)[IDS].tolist()
    assert request_digest(sent, IDS) == checksum.reference_digest(rows)


def test_digest_does_not_depend_on_where_blocks_lie(sent: torch.Tensor) -> None:
    cache, mine = landed(sent, IDS)
    assert mine != IDS
    assert request_digest(cache, mine) == request_digest(sent, IDS)


def test_chunking_does_not_change_the_digest(
    sent: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = request_digest(sent, IDS)
    # kv_digest's own name: checksum's is a re-export the digest never reads.
    monkeypatch.setattr(kv_digest, "CHUNK_BYTES", PAGE * 2)  # 3 chunks
    assert request_digest(sent, IDS) == whole


def test_digest_is_exact_on_overflowing_fragmented_blocks_in_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The torch digest against the plain-Python one where every sum wraps
    (full-range words, pages at the extremes), on strided pages (a block
    longer than its page, as region_pages reads a layer inside a larger
    block), fragmented ids out of order, several chunks with a short last
    one, and 2 threads (pages large enough that torch splits the work)."""
    words, gap, blocks = 16384, 64, 24
    g = torch.Generator().manual_seed(7)
    cache = torch.randint(
        -(2**31), 2**31, (blocks, words + gap), dtype=torch.int32, generator=g
    )
    cache[3, :words] = 2**31 - 1
    cache[4, :words] = -(2**31)
    pages = checksum.region_pages(
        {"c": cache}, cache.data_ptr(), (words + gap) * 4, words * 4, blocks
    )
    assert not pages.is_contiguous()
    ids = [21, 3, 4, 5, 17, 0, 23, 9, 8, 12, 2]
    want = checksum.reference_digest(pages[ids].tolist())
    threads = torch.get_num_threads()
    monkeypatch.setattr(kv_digest, "CHUNK_BYTES", 3 * words * 4)  # 3+3+3+2
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert int(checksum.digest(pages, torch.tensor(ids))) == want
    finally:
        torch.set_num_threads(threads)
    # The reference itself wraps: not a sum that never left 64 bits.
    assert checksum.reference_digest(pages[ids[:1]].tolist()) != 0


def _wrong_place(cache: torch.Tensor, mine: list[int], sent: torch.Tensor) -> None:
    # Block 1 of the request written over block 2's place; block 1's own
    # place keeps what was there.
    cache[mine[2]] = sent[IDS[1]]


def _stale(cache: torch.Tensor, mine: list[int], sent: torch.Tensor) -> None:
    cache[mine[3]] = torch.randn(TOKENS, LATENT)


def _zeros(cache: torch.Tensor, mine: list[int], sent: torch.Tensor) -> None:
    cache[mine[0]] = 0.0


def _all_zeros(cache: torch.Tensor, mine: list[int], sent: torch.Tensor) -> None:
    cache[mine] = 0.0


def _partial(cache: torch.Tensor, mine: list[int], sent: torch.Tensor) -> None:
    # The second half of one page never arrived: the stale bytes stay.
    cache[mine[4], TOKENS // 2 :] = torch.randn(TOKENS // 2, LATENT)


def _one_word(cache: torch.Tensor, mine: list[int], sent: torch.Tensor) -> None:
    cache[mine[1], 7, 11] = torch.nextafter(cache[mine[1], 7, 11], torch.tensor(9.0))


def _swapped(cache: torch.Tensor, mine: list[int], sent: torch.Tensor) -> None:
    cache[[mine[1], mine[3]]] = cache[[mine[3], mine[1]]].clone()


def _sign_flips(cache: torch.Tensor, mine: list[int], sent: torch.Tensor) -> None:
    # Two fp32 signs, in two blocks (in one block they cancel: below).
    cache[mine[2], 0, 0] = -cache[mine[2], 0, 0]
    cache[mine[3], 5, 1] = -cache[mine[3], 5, 1]


def _sign_and_mantissa(
    cache: torch.Tensor, mine: list[int], sent: torch.Tensor
) -> None:
    # Two values of one block negated and one of them rounded: not bit 31 alone.
    cache[mine[2], 0, :2] = -cache[mine[2], 0, :2]
    cache[mine[2], 0, 0] = torch.nextafter(cache[mine[2], 0, 0], torch.tensor(9.0))


def _the_fault(cache: torch.Tensor, mine: list[int], sent: torch.Tensor) -> None:
    faults.corrupt_blocks({"c": cache}, mine[:1], num_blocks=BLOCKS)


FAILURES = [
    _wrong_place,
    _stale,
    _zeros,
    _all_zeros,
    _partial,
    _one_word,
    _swapped,
    _sign_flips,
    _sign_and_mantissa,
    _the_fault,
]


@pytest.mark.parametrize("failure", FAILURES, ids=lambda f: f.__name__.strip("_"))
def test_each_failure_changes_the_digest(sent: torch.Tensor, failure: Any) -> None:
    cache, mine = landed(sent, IDS)
    before = cache.clone()
    failure(cache, mine, sent)
    assert not torch.equal(cache, before), "the failure changed nothing"
    assert request_digest(cache, mine) != request_digest(sent, IDS)


def test_the_known_miss_two_sign_bits_in_one_block(sent: torch.Tensor) -> None:
    """What 32-bit sums give up (checksum.py's docstring): a flip of bit 31
    moves s_i by W[j] * 2**31 = 2**31 (mod 2**32) whatever the odd W[j],
    so two such flips in one block cancel. Kept as a test so that a change
    of the math that closes (or widens) the gap is seen."""
    cache, mine = landed(sent, IDS)
    cache[mine[2], 0, :2] = -cache[mine[2], 0, :2]
    assert request_digest(cache, mine) == request_digest(sent, IDS)
    cache[mine[2], 0, 2] = -cache[mine[2], 0, 2]  # an odd number: seen
    assert request_digest(cache, mine) != request_digest(sent, IDS)


def test_a_plain_sum_would_miss_a_swap(sent: torch.Tensor) -> None:
    """Negative control for the position weights: without them (every
    position weighted 1) two swapped blocks give the same digest."""
    cache, mine = landed(sent, IDS)
    _swapped(cache, mine, sent)
    pages = pages_of(cache)
    w = checksum.word_weights(pages.shape[1], pages.device)
    unweighted = (pages[mine] * w).sum(dim=1, dtype=torch.int32).sum()
    assert unweighted == (pages_of(sent)[IDS] * w).sum(dim=1, dtype=torch.int32).sum()
    assert request_digest(cache, mine) != request_digest(sent, IDS)


def test_the_key_is_validated() -> None:
    extra_config.validate({"kv_checksum": True})
    with pytest.raises(extra_config.ExtraConfigError, match="kv_checksum"):
        extra_config.validate({"kv_checksum": "yes"})
    with pytest.raises(
        extra_config.ExtraConfigError, match="did you mean 'kv_checksum'"
    ):
        extra_config.validate({"kv_checksums": True})


def test_throughput_figures_are_measured() -> None:
    figures = checksum.measure_throughput(request_mib=8, cache_mib=64, rounds=1)
    print({k: round(v, 2) for k, v in figures.items()})
    assert figures["digest_GBps"] > 0 and figures["read_GBps"] > 0


# -- the handshake: both roles must agree -----------------------------------
def checksum_worker(enabled: bool, **state: Any) -> Any:
    # What shutdown() (run by __del__) touches: a __del__ that raises while
    # the garbage collector runs inside ast.parse trips CPython 3.11's AST
    # recursion check in a later test (test_contract).
    worker = make_worker(checksum_worker_class(), None, backport=False)
    worker._encoder = msgspec.msgpack.Encoder()
    worker.kv_cache_config = type("C", (), {"has_mamba_layers": False})()
    worker.tp_size, worker.pp_size = 1, 1
    for name, value in state.items():
        setattr(worker, name, value)
    worker._install_checksum({"kv_checksum": enabled})
    return worker


def checksum_worker_class() -> type:
    from pd_mooncake.connector import PDMooncakeConnectorWorker

    return PDMooncakeConnectorWorker


def pull_metadata(wants: bool | None) -> Any:
    """Decode's pull as a plugin decode with the check on/off (or upstream's,
    None) encodes it, as prefill decodes it."""
    meta = upstream.MooncakeXferMetadata(
        remote_hostname="127.0.0.1",
        remote_port=1,
        remote_tp_size=1,
        remote_tp_rank=0,
        req_blocks={"d-req": ("x", [[0]])},
        kv_caches_base_addr=[],
        block_lens=[],
        kv_block_lens=[],
    )
    raw = (
        msgspec.msgpack.encode(meta)
        if wants is None
        else checksum_worker(wants)._encoder.encode(meta)
    )
    return checksum_worker(False)._xfer_meta_decoder.decode(raw)


@pytest.mark.parametrize(
    ("prefill", "decode"), [(True, False), (True, None), (False, True)]
)
def test_prefill_refuses_a_decode_that_disagrees(
    prefill: bool, decode: bool | None
) -> None:
    send = upstream.SendBlockMeta("p-req", "x", [[3]], asyncio.Event())
    worker = checksum_worker(
        prefill, reqs_need_send={"x": send}, finished_sending_reqs=set()
    )
    ready = [("d-req", send)]
    built = asyncio.run(
        worker._build_transfer_params(ready, pull_metadata(decode), [], [])
    )
    src, _, _, err_reqs, err_msg = built
    assert (src, err_reqs) == ([], ["d-req"])
    assert "kv_checksum disagrees" in err_msg and "both roles" in err_msg
    # Nothing will ever be sent: prefill's blocks are freed now.
    assert worker.reqs_need_send == {} and worker.finished_sending_reqs == {"p-req"}


@pytest.mark.parametrize("scheme", [0, 1, kv_digest.SCHEME + 1])
def test_prefill_refuses_a_pull_of_another_digest_scheme(scheme: int) -> None:
    """A decode with the check on but another plugin version (0: one from
    before the scheme field, as it encodes its pull) is refused with both
    schemes named, before a byte is sent: its digests would differ on every
    request."""
    meta = pull_metadata(True)
    raw = msgspec.msgpack.encode(
        wire.XferMetadata(
            **{**msgspec.structs.asdict(meta), "pd_kv_digest_scheme": scheme}
        )
    )
    if scheme == 0:
        assert b"pd_kv_digest_scheme" not in raw  # what an older plugin sends
    send = upstream.SendBlockMeta("p-req", "x", [[3]], asyncio.Event())
    worker = checksum_worker(
        True, reqs_need_send={"x": send}, finished_sending_reqs=set()
    )
    pull = worker._xfer_meta_decoder.decode(raw)
    built = asyncio.run(worker._build_transfer_params([("d-req", send)], pull, [], []))
    src, _, _, err_reqs, err_msg = built
    assert (src, err_reqs) == ([], ["d-req"])
    theirs = f"scheme {scheme}" if scheme else "no scheme"
    assert "digest schemes differ" in err_msg and "same pd_mooncake version" in err_msg
    assert f"prefill computes scheme {kv_digest.SCHEME}" in err_msg
    assert f"decode 127.0.0.1:1 {theirs}" in err_msg
    assert worker.reqs_need_send == {} and worker.finished_sending_reqs == {"p-req"}
    # This plugin's own pull carries its scheme and is not refused.
    assert pull_metadata(True).pd_kv_digest_scheme == kv_digest.SCHEME
    assert worker._checksum_refusal(pull_metadata(True)) is None


def test_decode_fails_a_request_an_upstream_prefill_sent_no_digest_for() -> None:
    failed = []
    worker = checksum_worker(
        True, _handle_failed_recv=lambda metas, ids, why: failed.append((ids, why))
    )
    meta = upstream.PullReqMeta("d-req", "x", [[0]], "p", "http://p")
    # Upstream's prefill: its plain response, decoded by decode's decoder.
    plain = upstream.MooncakeXferResponse(
        status=upstream.MooncakeXferResponseStatus.FINISH, ok_reqs=["d-req"]
    )
    response = worker._xfer_resp_decoder.decode(msgspec.msgpack.encode(plain))
    worker._verify_kv_digests(response, {"d-req": meta})
    assert response.ok_reqs is None
    assert failed and "prefill sent no KV digest" in failed[0][1]


# -- two real Mooncake engines ---------------------------------------------
def decode_side(
    to_prefill: Any, from_prefill: Any, enabled: bool, fault: str | None
) -> None:
    """Decode: register zeroed caches, send the pull (with the wish), verify
    prefill's answer as process_pulling_result does, report the verdict."""
    if fault:
        os.environ[faults.FAULT_ENV] = fault
    caches = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    worker, _ = connector_worker(caches, consumer=True, backport=False)
    worker._encoder = msgspec.msgpack.Encoder()
    worker._install_checksum({"kv_checksum": enabled})
    worker.finished_recving_reqs = set()
    worker._invalid_block_ids = queue.Queue()
    worker._failed_recv_reqs = queue.Queue()
    worker._is_hma_required = True  # two KV cache groups: per request
    blocks = [DECODE_BLOCKS, DECODE_BLOCKS]
    metadata = worker_pull(worker, blocks)
    to_prefill.put(worker._encoder.encode(metadata))
    response = worker._xfer_resp_decoder.decode(from_prefill.get(timeout=DEADLINE_S))
    pull = upstream.PullReqMeta(
        "d-req", "xfer-1", blocks, "p", "http://p", pull_tasks_count=1
    )
    reasons: list[str] = []
    handle = worker._handle_failed_recv

    def failed_recv(metas: dict, ids: Any, reason: str) -> None:
        reasons.append(reason)
        handle(metas, ids, reason)

    worker._handle_failed_recv = failed_recv
    worker.process_pulling_result(response, {"d-req": pull})
    failed = []
    while not worker._failed_recv_reqs.empty():
        failed.append(worker._failed_recv_reqs.get())
    stats = worker.xfer_stats.data
    to_prefill.put(
        {
            "finished": sorted(worker.finished_recving_reqs),
            "failed": failed,
            "loaded": bool(getattr(pull, "pd_loaded", False)),
            "match": stats.get(checksum.MATCH_KEY, []),
            "mismatch": stats.get(checksum.MISMATCH_KEY, []),
            "failed_recvs": len(stats.get("num_failed_recvs", [])),
            "reasons": reasons,
        }
    )


def scheme_1_digest(pages: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The digest as a plugin from before 2026-12-03 computes it (64-bit
    word weights, sums modulo 2**64): what an older prefill sends."""
    with np.errstate(over="ignore"):
        w = kv_digest._splitmix64(pages.shape[1], 0x5EED_0001).view(np.int64)
        p = kv_digest._splitmix64(len(ids), 0x5EED_0002).view(np.int64)
    rows = pages.index_select(0, ids).to(torch.int64)
    return ((rows * torch.from_numpy(w)).sum(1) * torch.from_numpy(p)).sum()


def as_an_older_prefill(worker: Any, raw: bytes, blocks: list[list[int]]) -> bytes:
    """Prefill's answer as a plugin from before digest schemes sends it:
    scheme-1 digests of the same blocks and no scheme field."""
    answer = worker._xfer_resp_decoder.decode(raw)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checksum, "digest", scheme_1_digest)
        old = worker._kv_digests(blocks)
    assert old != answer.pd_kv_digests["d-req"]  # the math did change
    fields = msgspec.structs.asdict(answer)
    fields.update(pd_kv_digests={"d-req": old}, pd_kv_digest_scheme=0)
    return msgspec.msgpack.encode(wire.XferResponse(**fields))


def pull_through_mooncake(
    enabled: bool, fault: str | None, older_prefill: bool = False
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    to_prefill, from_prefill = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(
        target=decode_side, args=(to_prefill, from_prefill, enabled, fault), daemon=True
    )
    proc.start()
    try:
        prefill = checksum_worker_class()
        generator = torch.Generator().manual_seed(1)
        caches = {n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}
        worker, engine = connector_worker(caches, consumer=False, backport=False)
        worker._encoder = msgspec.msgpack.Encoder()
        worker._install_checksum({"kv_checksum": enabled})
        assert isinstance(worker, prefill)
        meta = worker._xfer_meta_decoder.decode(to_prefill.get(timeout=DEADLINE_S))
        local, remote, err = worker._prepare_transfer_regions(meta)
        assert err is None, err
        send_meta = upstream.SendBlockMeta(
            "p-req", "xfer-1", [PREFILL_BLOCKS, PREFILL_BLOCKS], asyncio.Event()
        )
        worker.engine = engine.engine

        async def send_and_answer() -> bytes:
            # As upstream's send_kv_to_decode: build, send, encode the answer,
            # in one task.
            src, dst, lens, errs, _ = await worker._build_transfer_params(
                [("d-req", send_meta)], meta, local, remote
            )
            assert errs == []
            session = f"{meta.remote_hostname}:{meta.remote_port}"
            assert worker._send_blocks(session, src, dst, lens) == 0
            return worker._encoder.encode(
                upstream.MooncakeXferResponse(
                    status=upstream.MooncakeXferResponseStatus.FINISH,
                    ok_reqs=["d-req"],
                )
            )

        answer = asyncio.run(send_and_answer())
        if older_prefill:
            blocks = [PREFILL_BLOCKS, PREFILL_BLOCKS]
            answer = as_an_older_prefill(worker, answer, blocks)
        from_prefill.put(answer)
        return to_prefill.get(timeout=DEADLINE_S)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


REGIONS = [
    ("model.layers.0.self_attn.attn", "MLA-latent"),
    ("model.layers.8.self_attn.attn", "GQA K/V"),
]


def test_intact_transfer_is_verified_and_received() -> None:
    got = pull_through_mooncake(enabled=True, fault=None)
    assert got["finished"] == ["d-req"] and got["loaded"] and got["failed"] == []
    assert sorted(got["match"]) == sorted(REGIONS) and got["mismatch"] == []


def test_decode_refuses_an_older_prefills_digests_instead_of_comparing() -> None:
    """An intact transfer from a prefill whose digests are another scheme's
    (here scheme 1, as a plugin from before the scheme field sends them):
    failed with both schemes named, not counted as a mismatch."""
    got = pull_through_mooncake(enabled=True, fault=None, older_prefill=True)
    assert got["failed"] == ["d-req"] and not got["loaded"]
    assert got["match"] == got["mismatch"] == []
    (reason,) = got["reasons"]
    assert "digest schemes differ" in reason and "no scheme" in reason
    assert f"decode computes scheme {kv_digest.SCHEME}" in reason


def test_corrupted_receive_fails_through_upstreams_failed_recv_path() -> None:
    got = pull_through_mooncake(enabled=True, fault=faults.CORRUPT_RECEIVED_KV)
    # Reported finished as failed: the scheduler fails or recomputes it
    # (kv_load_failure_policy) and never caches its blocks.
    assert got["failed"] == ["d-req"] and not got["loaded"]
    assert got["failed_recvs"] == 1
    assert sorted(got["mismatch"]) == sorted(REGIONS) and got["match"] == []


def test_without_the_check_a_corrupted_receive_is_reported_received() -> None:
    """Negative control: the same fault with kv_checksum off (the plugin
    before this check) passes as a good load."""
    got = pull_through_mooncake(enabled=False, fault=faults.CORRUPT_RECEIVED_KV)
    assert got["finished"] == ["d-req"] and got["loaded"] and got["failed"] == []
    assert got["match"] == got["mismatch"] == []


def test_corruption_after_the_check_is_not_seen_by_it() -> None:
    """What the checksum cannot catch: decode's blocks overwritten after it
    verified them (the e2e correctness check's own negative control)."""
    got = pull_through_mooncake(enabled=True, fault=faults.CORRUPT_CHECKED_KV)
    assert got["finished"] == ["d-req"] and got["loaded"] and got["failed"] == []
    assert sorted(got["match"]) == sorted(REGIONS) and got["mismatch"] == []
