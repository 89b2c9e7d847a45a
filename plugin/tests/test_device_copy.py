"""pd_mooncake.device_copy: the indexed copy against the per-run copy it
replaced, byte for byte, on fragmented block lists of the target's FlashMLA
and the draft's FlashAttention layouts; and the ordering against the forward
stream, recorded with the stand-ins (no GPU here)."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from pd_mooncake import device_copy

MLA_BLOCK = 64  # FlashMLA's kernel block
DRAFT_BLOCK = 16
BLOCKS = 48


def caches(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """A FlashMLA latent layer (blocks, 64, 576) and a FlashAttention draft
    layer (2, blocks, 16, 8, 64): K and V apart, so a block is two ranges."""
    g = torch.Generator().manual_seed(seed)
    mla = torch.randn(BLOCKS, MLA_BLOCK, 576, generator=g).to(dtype)
    draft = torch.randn(2, BLOCKS, DRAFT_BLOCK, 8, 64, generator=g).to(dtype)
    return [mla, draft]


def regions(kv: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(base address, block bytes) of each region: MLA, draft K, draft V."""
    mla, draft = kv
    return [(t.data_ptr(), t[0].nbytes) for t in (mla, draft[0], draft[1])]


def descriptors(
    src: list[tuple[int, int]],
    src_ids: list[int],
    dst: list[tuple[int, int]],
    dst_ids: list[int],
) -> tuple[list[int], list[int], list[int]]:
    """Upstream's descriptors: per region, one per run of blocks consecutive
    on both sides (fragmented lists make many)."""
    runs: list[list[int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    srcs, dsts, lengths = [], [], []
    for (s_base, block), (d_base, _) in zip(src, dst, strict=True):
        for s, d, n in runs:
            srcs.append(s_base + s * block)
            dsts.append(d_base + d * block)
            lengths.append(n * block)
    return srcs, dsts, lengths


def per_run(dsts: list[int], srcs: list[int], lengths: list[int]) -> None:
    """The copy it replaced: one per descriptor."""
    for d, s, n in zip(dsts, srcs, lengths, strict=True):
        ctypes.memmove(d, s, n)


def record_of(kv: list[torch.Tensor], count: int) -> tuple[torch.Tensor, list]:
    """A staging record's data for ``count`` blocks of every region, region
    after region (as a send's descriptors are ordered)."""
    sizes = [block for _, block in regions(kv)]
    record = torch.zeros(count * sum(sizes), dtype=torch.uint8)
    at, bases = record.data_ptr(), []
    for block in sizes:
        bases.append((at, block))
        at += count * block
    return record, bases


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexed_gather_and_scatter_match_the_per_run_copy(dtype) -> None:
    rng = random.Random(7)
    sent = rng.sample(range(BLOCKS), 29)
    sent[3:6] = [40, 41, 42]  # one run among the fragments
    landed = rng.sample(range(BLOCKS), 29)
    prefill = caches(dtype, 1)
    kv = device_copy.Memory(prefill)

    # Gather into a record: the indexed copy, and the per-run copy.
    record, slots = record_of(prefill, len(sent))
    expected, expected_slots = record_of(prefill, len(sent))
    order = list(range(len(sent)))
    srcs, dsts, lengths = descriptors(regions(prefill), sent, slots, order)
    assert len(srcs) > 60  # fragmented
    copies = device_copy.move(device_copy.Memory([record]), dsts, kv, srcs, lengths)
    assert copies == 2  # one per tensor, not one per descriptor
    srcs, dsts, lengths = descriptors(regions(prefill), sent, expected_slots, order)
    per_run(dsts, srcs, lengths)
    assert torch.equal(record, expected)

    # Scatter the record into decode's blocks (other ids).
    decode, reference = caches(dtype, 2), caches(dtype, 2)
    srcs, dsts, lengths = descriptors(slots, order, regions(decode), landed)
    assert (
        device_copy.move(
            device_copy.Memory(decode),
            dsts,
            device_copy.Memory([record]),
            srcs,
            lengths,
        )
        == 2
    )
    srcs, dsts, lengths = descriptors(slots, order, regions(reference), landed)
    per_run(dsts, srcs, lengths)
    for got, want in zip(decode, reference, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # And the blocks hold prefill's: the sent block i is landed block i.
    assert torch.equal(decode[0][landed], prefill[0][sent])
    assert torch.equal(decode[1][:, landed], prefill[1][:, sent])


def test_a_range_outside_registered_memory_moves_nothing() -> None:
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros(8192, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not registered"):
        device_copy.move(
            device_copy.Memory([dst]),
            [dst.data_ptr(), dst.data_ptr() + 8000],
            device_copy.Memory([src]),
            [src.data_ptr(), src.data_ptr()],
            [512, 512],
        )
    assert not dst.any()


def test_staged_copies_wait_on_the_kv_mark_never_on_the_forward_stream(
    monkeypatch,
) -> None:
    """The ordering with recording stand-ins for CUDA's streams: the staging
    stream waits on the latest KV-ready event recorded on the forward stream,
    the host on the staging stream's own event; nothing waits on the device
    or on the forward stream."""

    def device_wide(*args: object) -> None:
        raise AssertionError("torch.cuda.synchronize: waits for the forward step")

    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    log: list[str] = []
    ordering = device_copy.Ordering("cuda:5", device_copy.HostStreams(log))
    src = torch.arange(1024, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    ordering.mark_kv_ready()  # step N's bind
    ordering.mark_kv_ready()  # step N+1's bind: the latest counts
    with ordering.staged():
        log.append("copy")
        device_copy.move(
            device_copy.Memory([dst]),
            [dst.data_ptr()],
            device_copy.Memory([src]),
            [src.data_ptr()],
            [src.numel()],
        )
    assert log == [
        "record kv-ready#1 on forward",
        "record kv-ready#2 on forward",
        "staging waits for kv-ready#2",
        "copy",
        "record staged#3 on staging",
        "host waits for staged#3",
    ]
    assert not any("all of" in line for line in log)
    assert torch.equal(dst, src)


def test_copy_without_a_mark_runs_on_the_host_stand_ins(monkeypatch) -> None:
    """CPU memory (the twin): no stream, no event, no device-wide wait."""
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda *a: pytest.fail("device-wide wait")
    )
    src = torch.full((4096,), 9, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    device_copy.copy(
        device_copy.Memory([dst]),
        [dst.data_ptr()],
        device_copy.Memory([src]),
        [src.data_ptr()],
        [4096],
    )
    assert dst.eq(9).all()


def test_the_staging_buffer_lives_where_the_transport_reads() -> None:
    gpu = torch.device("cuda", 3)
    assert device_copy.staging_home("tcp", gpu) == torch.device("cpu")  # pinned host
    assert device_copy.staging_home("rdma", gpu) == gpu  # GPUDirect
    assert device_copy.staging_home("tcp", torch.device("cpu")) == torch.device("cpu")
