"""pd_mooncake.staging: spans, records, and a staged send end to end in
memory (prefill's gather, the write as a plain copy of the chunks, decode's
scatter); the real transfer runs in the e2e suite."""

from __future__ import annotations

import ctypes
import random
from types import SimpleNamespace

import pytest
import torch

from pd_mooncake import staging, staging_worker

BLOCK = 4096 + 512  # not a multiple of ALIGN: records of odd sizes


def test_spans_are_reused_merged_and_held_back() -> None:
    arena = staging.Arena(torch.empty(64 * staging.ALIGN, dtype=torch.uint8))
    a = arena.reserve(10 * staging.ALIGN)
    b = arena.reserve(staging.ALIGN + 1)  # rounded up to two pages
    assert (a, b) == (0, 10 * staging.ALIGN)
    assert arena.reserve(64 * staging.ALIGN) is None
    arena.release(a, 10 * staging.ALIGN)
    arena.release(b, staging.ALIGN + 1)
    assert arena.reserve(64 * staging.ALIGN) == 0  # merged again
    arena.release(0, 64 * staging.ALIGN, hold_s=60.0)
    assert arena.held() == 64 * staging.ALIGN
    assert arena.reserve(staging.ALIGN) is None  # a held span is not reused


def test_a_copy_outside_registered_memory_is_refused_before_any_byte() -> None:
    kv = staging.Memory([torch.zeros(4 * BLOCK, dtype=torch.uint8)])
    buffer_tensor = torch.full((4 * BLOCK,), 7, dtype=torch.uint8)
    buffer = staging.Memory([buffer_tensor])
    base = _base(kv)
    src = buffer_tensor.data_ptr()
    with pytest.raises(ValueError, match="not registered"):
        # The second destination runs past the cache: nothing is copied.
        staging.copy(kv, [base, base + 3 * BLOCK + 1], buffer, [src, src], [BLOCK] * 2)
    assert not kv.view(base, 4 * BLOCK).any()
    staging.copy(kv, [base], buffer, [src], [BLOCK])
    assert kv.view(base, BLOCK).eq(7).all()


def _base(memory: staging.Memory) -> int:
    return memory._starts[0]


def _worker(kv: torch.Tensor, mib: int = 4) -> staging_worker.StagingWorker:
    worker = staging_worker.StagingWorker()
    worker.staging_bytes = mib << 20
    worker.device_kv_caches = {"layer": kv}
    worker.engine = SimpleNamespace(register_memory=lambda ptr, n: 0)
    worker.block_len_per_layer = [BLOCK]
    worker.xfer_stats = SimpleNamespace(record_staging=lambda phase, seconds: None)
    worker._logical_to_kernel_block_ids = lambda ids: ids
    worker._register_staging()
    return worker


def _send_through_staging(scramble: bool) -> tuple[torch.Tensor, torch.Tensor, list]:
    prefill_kv = torch.randint(0, 255, (64 * BLOCK,), dtype=torch.uint8)
    decode_kv = torch.zeros(64 * BLOCK, dtype=torch.uint8)
    prefill, decode = _worker(prefill_kv), _worker(decode_kv)
    blocks = random.Random(3).sample(range(64), 20)
    mine = random.Random(4).sample(range(64), 20)
    pull = {"r": SimpleNamespace(local_block_ids=[mine], failed=False)}
    offer = decode._staging_reserve(pull)
    assert offer is not None
    p, d = prefill_kv.data_ptr(), decode_kv.data_ptr()
    src = [p + b * BLOCK for b in blocks]
    dst = [d + b * BLOCK for b in mine]
    staging.TARGET.set(staging.Target.from_wire(offer.wire))
    staged = prefill._stage_send(src, dst, [BLOCK] * len(src))
    assert staged is not None and len(staged.src) == 1  # one record, < 1 MiB
    # The transfer engine's write, as a copy of each chunk.
    for s, t, n in zip(staged.src, staged.dst, staged.lengths, strict=True):
        ctypes.memmove(t, s, n)
    if scramble:  # a byte of the table: a destination outside the caches
        ctypes.memset(staged.dst[0] + 8 * staging.HEAD_WORDS + 3, 0xFF, 1)
    prefill._staged_sent(staged, ok=True, resends=0, seconds=0.0)
    answer = SimpleNamespace(ok_reqs=["r"])
    answer.__dict__.update(staging_worker._answer_fields(answer))
    staging.OFFER.set(offer)
    decode._staging_scatter(answer, pull)
    return (
        prefill_kv.view(64, BLOCK)[blocks],
        decode_kv.view(64, BLOCK)[mine],
        [prefill, decode, offer, pull],
    )


def test_a_staged_send_lands_in_decode_blocks_in_order() -> None:
    sent, landed, (prefill, decode, offer, pull) = _send_through_staging(False)
    assert torch.equal(sent, landed)
    assert offer.answered == {"r"}
    decode._staging_close(offer, pull)
    assert decode._arena.held() == 0
    assert prefill._arena.reserve(prefill.staging_bytes) == 0  # all given back


def test_a_record_naming_memory_outside_the_caches_is_refused() -> None:
    with pytest.raises(ValueError, match="not registered"):
        _send_through_staging(scramble=True)


def test_a_failed_resent_or_unanswered_pull_holds_its_span_back() -> None:
    decode = _worker(torch.zeros(64 * BLOCK, dtype=torch.uint8))
    pull = {"r": SimpleNamespace(local_block_ids=[[1, 2, 3]])}
    for answered, clean in ((set(), True), ({"r"}, False)):
        offer = decode._staging_reserve(pull)
        offer.answered, offer.clean = answered, clean
        decode._staging_close(offer, pull)
        assert decode._arena.held() >= offer.nbytes
    assert decode._arena.held() == 2 * staging.aligned(offer.nbytes)


def test_the_span_holds_any_record_of_its_requests() -> None:
    """span_bound against the largest record a pull's requests can make: one
    descriptor per block and region, every region's bytes."""
    block_bytes = [36864] * 8 + [16384]
    counts = [1, 7, 300]
    worst = sum(
        staging.aligned(
            staging.record_bytes([b for _ in range(n) for b in block_bytes])
        )
        for n in counts
    )
    assert staging.span_bound(counts, block_bytes) >= worst


def test_chunks_cover_the_record_exactly() -> None:
    n = 3 * staging.CHUNK_BYTES + 5
    src, dst, lengths = staging.chunks(1000, 5000, n)
    assert sum(lengths) == n and len(src) == 4
    assert [d - s for s, d in zip(src, dst, strict=True)] == [4000] * 4
    assert src == [1000 + i * staging.CHUNK_BYTES for i in range(4)]


@pytest.mark.parametrize("entries, payload", [(1, 0), (9, 36864), (4608, 150_000_000)])
def test_record_descriptors_bound_a_records_chunks(entries: int, payload: int) -> None:
    """The e2e bound on a staged send's descriptors: its header and bytes
    in CHUNK_BYTES pieces."""
    record = staging.record_bytes([0] * entries) + payload
    assert staging.record_descriptors(entries, payload) == -(
        -record // staging.CHUNK_BYTES
    )
