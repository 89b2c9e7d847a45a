"""The KV digest of pd_mooncake.checksum (its docstring says what it is and
why), without vLLM: the connector's checksum, the benchmark and
scripts/gpu-datapath-check use the same arithmetic."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

# The digest's math, as the side channel names it (wire: decode's pull and
# prefill's answer carry it). Raise it with any change that alters a digest
# (weights, seeds, arithmetic): a prefill and a decode on different schemes
# then refuse each other with the reason instead of failing every request
# as a mismatch. 1 (implicit, before the field existed): 64-bit word
# weights; 2: 32-bit per-block sums.
SCHEME = 2
# Bytes gathered per step: few kernels, and the chunk stays in cache between
# the gather, the multiply and the sum. Measured 2026-12-03 on the 2-core
# EPYC (1 MiB L2 per core, 32 MiB L3), 1 thread, 152 MiB of 36 KiB pages
# scattered in 512 MiB, best of 9, CPU-s/GiB: 256 KiB 0.16, 512 KiB 0.15,
# 1 MiB 0.14, 2 MiB 0.13, 4 MiB 0.13, 8 MiB 0.14.
CHUNK_BYTES = 2 << 20
_MASK = (1 << 64) - 1
_WORD_SEED, _POSITION_SEED = 0x5EED_0001, 0x5EED_0002


# -- the digest --------------------------------------------------------------
def _splitmix64(n: int, seed: int) -> np.ndarray:
    """n odd 64-bit constants (host-side tables only: the tensors are
    digested with torch ops, on their own device)."""
    x = (np.arange(1, n + 1, dtype=np.uint64) + np.uint64(seed)) * np.uint64(
        0x9E3779B97F4A7C15
    )
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))) | np.uint64(1)


@functools.cache
def _weights(n: int, seed: int, bits: int, device: torch.device) -> torch.Tensor:
    with np.errstate(over="ignore"):
        table = _splitmix64(n, seed)
    if bits == 32:  # the low half: odd too
        table = (table & np.uint64(0xFFFF_FFFF)).astype(np.uint32).view(np.int32)
    else:
        table = table.view(np.int64)
    return torch.from_numpy(table.copy()).to(device)


def word_weights(words: int, device: torch.device) -> torch.Tensor:
    """W: odd 32-bit constants (int32), one per word of a page."""
    return _weights(words, _WORD_SEED, 32, device)


def position_weights(n: int, device: torch.device) -> torch.Tensor:
    """P: odd 64-bit constants (int64), one per position in the block list."""
    # Cached in powers of two: requests differ in length.
    size = 1 << max(n - 1, 0).bit_length()
    return _weights(size, _POSITION_SEED, 64, device)[:n]


def digest(pages: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The 0-d int64 digest of ``pages[block_ids]`` (``pages``: one row of
    int32 words per block), on ``pages``' device."""
    n, words = int(block_ids.numel()), pages.shape[1]
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=pages.device)
    if pages.dtype != torch.int32:
        raise TypeError(f"pages must be int32 words, not {pages.dtype}")
    w = word_weights(words, pages.device)
    step = max(1, CHUNK_BYTES // max(1, 4 * words))
    # Allocated once per call, not per chunk: on CUDA the caching allocator
    # makes that cheap and orders it on the caller's stream; on CPU a buffer
    # kept per thread measured no faster (0.14 CPU-s/GiB either way, 49 vs
    # 51 us for a one-block request).
    buf = torch.empty((min(step, n), words), dtype=torch.int32, device=pages.device)
    sums = torch.empty(n, dtype=torch.int32, device=pages.device)
    # Three ops per chunk: gather into buf, multiply in place, per-block sums
    # in int32 (mod 2**32 whatever torch accumulates in: the result is cut
    # to int32) written straight into sums.
    for ids, out in zip(block_ids.split(step), sums.split(step), strict=True):
        rows = buf if len(ids) == step else buf[: len(ids)]
        torch.index_select(pages, 0, ids, out=rows)
        rows.mul_(w)
        torch.sum(rows, 1, dtype=torch.int32, out=out)
    # int32 -> int64 sign-extends s_i; the products and the sum wrap mod 2**64.
    return (sums.to(torch.int64) * position_weights(n, pages.device)).sum()


def reference_digest(rows: Sequence[Sequence[int]]) -> int:
    """The digest in plain Python (the tests' check of the torch one): per
    block s_i = sum_j W[j] x[i,j] mod 2**32, read as signed;
    D = sum_i P[i] s_i mod 2**64, read as signed."""
    if not rows:
        return 0
    words = len(rows[0])
    w = [x & 0xFFFF_FFFF for x in _splitmix64(words, _WORD_SEED).tolist()]
    p = _splitmix64(len(rows), _POSITION_SEED).tolist()
    total = 0
    for pi, row in zip(p, rows, strict=True):
        s = sum(wj * x for wj, x in zip(w, row, strict=True)) & 0xFFFF_FFFF
        total += pi * (s - (1 << 32) if s >= 1 << 31 else s)
    value = total & _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def region_pages(
    caches: dict[str, torch.Tensor],
    base: int,
    block_len: int,
    page_len: int,
    num_blocks: int,
) -> torch.Tensor:
    """The (num_blocks, page_len / 4) int32 view of a registered region:
    block b's page is [base + b * block_len, + page_len), as Mooncake
    addresses it, on the tensor that holds it."""
    end = base + (num_blocks - 1) * block_len + page_len
    for cache in caches.values():
        storage = cache.untyped_storage()
        start = storage.data_ptr()
        if start <= base and end <= start + storage.nbytes():
            break
    else:
        raise ValueError(f"no KV tensor holds the region at {base:#x}")
    if (base - start) % 4 or block_len % 4 or page_len % 4 or storage.nbytes() % 4:
        raise ValueError(f"region at {base:#x}: pages are not whole int32 words")
    raw = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage)
    return raw.view(torch.int32).as_strided(
        (num_blocks, page_len // 4), (block_len // 4, 1), (base - start) // 4
    )
