"""CPU_ATTN at block size 16 (vec16 kernel) computes what it computes at 32.

``pd_mooncake.cpu_support.allow_cpu_attn_block_size_16`` only changes what
CPU_ATTN *declares*; the 16-token kernel is upstream code that upstream only picks
for head sizes that are not a multiple of 32. So the declaration is only safe if
the vec16 kernel is the same attention as the native 32-token one. These
tests drive the same custom ops, in the same order and with the same arguments,
as ``CPUAttentionMetadataBuilder.build`` / ``CPUAttentionBackendImpl.forward``
/ ``do_kv_cache_update``, at both block sizes, and check both against a plain
float64 PyTorch attention.

The fresh interpreter that checks upstream's declaration is started at
collection, so its slow vLLM import overlaps the rest of this module.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pd_mooncake import DISABLE_ENV
from pd_mooncake.cpu_support import allow_cpu_attn_block_size_16

VENV_PYTHON = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"

# Eagle3 draft attention on the reference deployment.
NUM_HEADS = 4
NUM_KV_HEADS = 2
DTYPE = torch.float32
NATIVE_BLOCK_SIZE = 32

# Measured on x86 AVX2 (vec16 vs vec), float32: block 16 vs 32 bit-identical
# (0.0), each vs the float64 reference <= 1.9e-6. Only float32 summation order may
# legitimately differ (other ISAs, split points), so 1e-5 leaves ~5x margin on the
# worst measured case, while wrong addressing moves outputs by ~1 (see below).
BLOCK_SIZE_ATOL = 1e-5
REFERENCE_ATOL = 1e-5
WRONG_MIN_DIFF = 0.1

# A fresh interpreter that never calls our patch: with the kill switch set, and
# without vLLM's load_general_plugins (plain imports do not call it; the probe
# prints plugins_loaded to show it), it sees upstream's MultipleOf(32).
UPSTREAM_PROBE = """
import vllm.plugins
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
from vllm.v1.worker.utils import select_common_block_size

print("plugins_loaded", vllm.plugins.plugins_loaded)
print("declared", CPUAttentionBackend.get_supported_kernel_block_sizes())
try:
    size = select_common_block_size(16, [CPUMLABackend, CPUAttentionBackend])
except ValueError as exc:
    print("ValueError", exc)
else:
    print("selected", size)
"""


def start_upstream_probe() -> subprocess.Popen[str]:
    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    return subprocess.Popen(
        [str(python), "-c", UPSTREAM_PROBE],
        env={**os.environ, DISABLE_ENV: "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def reap(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    # Closes the pipes, unless test_upstream_* already read them.
    if proc.stdout is not None and not proc.stdout.closed:
        proc.communicate()


# Started at collection rather than in a fixture: its vLLM import (10-20 s on a
# busy 2-core host) then overlaps this process's imports and the kernel tests
# instead of adding to them. Session fixtures (conftest's plugin registration)
# run before any module fixture, so a fixture would start it too late.
UPSTREAM = start_upstream_probe()
atexit.register(reap, UPSTREAM)


@dataclass(frozen=True)
class Batch:
    """One scheduler step: per request, tokens already cached + tokens queried."""

    seq_lens: list[int]
    query_lens: list[int]
    head_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


@dataclass(frozen=True)
class Inputs:
    queries: list[torch.Tensor]  # per request [query_len, NUM_HEADS, head]
    keys: list[torch.Tensor]  # per request [seq_len, NUM_KV_HEADS, head]
    values: list[torch.Tensor]


CASES: dict[str, tuple[list[int], list[int]]] = {
    # Fresh prefills around the 16/32 block edges, plus one lone token.
    "prefill": ([1, 15, 16, 17, 33, 81], [1, 15, 16, 17, 33, 81]),
    # One new token per request, context already in the cache.
    "decode": ([2, 16, 17, 32, 33, 97], [1, 1, 1, 1, 1, 1]),
    # Last chunk of longer prompts whose earlier chunks are cached; chunk
    # boundaries deliberately off the block grid.
    "chunked_prefill": ([40, 81, 130], [8, 17, 33]),
    # What the scheduler really sends: decodes first, then a chunk and a prefill.
    "mixed": ([33, 70, 90, 23], [1, 1, 29, 23]),
    # A lone long decode: the one shape where the scheduler may split the KV
    # range across threads and merge partial softmaxes (split-KV).
    "long_decode": ([1000], [1]),
}

# Case x head size x (threads, split-KV). Most runs use one thread: the kernels
# are ~10 ms of work, but on a shared 2-core host two OpenMP threads spin at
# barriers for ~20x that, starving the upstream probe. The thread count changes
# the scheduler's work partition, so every case also runs at 2 threads with
# split-KV on (vLLM's default, VLLM_CPU_ATTN_SPLIT_KV=1).
SWEEP = [
    pytest.param(case, head, threads, split, id=f"{case}-h{head}-t{threads}-{tag}")
    for case in CASES
    for head, threads, split, tag in [
        (64, 1, True, "split"),
        (64, 1, False, "nosplit"),
        (128, 1, True, "split"),
        (128, 1, False, "nosplit"),
        (64, 2, True, "split"),
    ]
]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    # torch.set_num_threads also sets OpenMP's, which the CPU_ATTN ops use.
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_inputs(batch: Batch, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=DTYPE)

    return Inputs(
        queries=[randn(q, NUM_HEADS, batch.head_size) for q in batch.query_lens],
        keys=[randn(s, NUM_KV_HEADS, batch.head_size) for s in batch.seq_lens],
        values=[randn(s, NUM_KV_HEADS, batch.head_size) for s in batch.seq_lens],
    )


def shuffled_block_table(batch: Batch, block_size: int, seed: int) -> torch.Tensor:
    """Block table whose rows point at scattered, non-monotonic physical blocks.

    Ids come from a permutation of a pool with 5 spare blocks, so logical and
    physical order disagree; padding entries point at a spare block of garbage
    so a kernel reading past seq_len would pick up noise, not zeros.
    """
    blocks_per_req = [math.ceil(s / block_size) for s in batch.seq_lens]
    num_blocks = sum(blocks_per_req) + 5
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.full((batch.num_reqs, max(blocks_per_req)), int(ids[-1]))
    start = 0
    for row, n in enumerate(blocks_per_req):
        table[row, :n] = ids[start : start + n]
        start += n
    return table.to(torch.int32)


def slot_mapping(
    table: torch.Tensor, block_size: int, req: int, positions: range
) -> torch.Tensor:
    # Same formula as vLLM's BlockTable.compute_slot_mapping.
    pos = torch.tensor(list(positions), dtype=torch.int64)
    return table[req, pos // block_size].to(torch.int64) * block_size + pos % block_size


def run_cpu_attn(
    batch: Batch,
    inputs: Inputs,
    block_size: int,
    table: torch.Tensor,
    *,
    enable_kv_split: bool,
    read_table: torch.Tensor | None = None,
    seq_lens_override: list[int] | None = None,
) -> tuple[torch.Tensor, str]:
    """Write the KV cache and attend exactly as the CPU_ATTN backend does.

    ``read_table`` / ``seq_lens_override`` corrupt only the attention step (the
    cache is still written through ``table``), for the negative controls.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    head = batch.head_size
    isa = _get_attn_isa(DTYPE, block_size, head, "auto")
    num_blocks = int(table.max()) + 1
    # Random, not zeros: an unwritten or wrongly addressed slot must show up.
    kv_cache = torch.randn(
        num_blocks,
        NUM_KV_HEADS,
        block_size,
        2 * head,
        generator=torch.Generator().manual_seed(1234),
        dtype=DTYPE,
    )
    # The backend's view: [blocks, kv_heads, 2 * block_size, head], halves on dim 2.
    view = kv_cache.view(num_blocks, NUM_KV_HEADS, block_size * 2, -1)
    key_cache, value_cache = view.chunk(2, dim=2)

    def write(req: int, positions: range) -> None:
        if not positions:
            return
        ops.cpu_attn_reshape_and_cache(
            inputs.keys[req][positions.start : positions.stop],
            inputs.values[req][positions.start : positions.stop],
            key_cache,
            value_cache,
            slot_mapping(table, block_size, req, positions),
            isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )

    # Earlier steps cached each request's context; this step's
    # do_kv_cache_update then writes the query tokens before forward.
    for req, (s, q) in enumerate(zip(batch.seq_lens, batch.query_lens, strict=True)):
        write(req, range(s - q))
    for req, (s, q) in enumerate(zip(batch.seq_lens, batch.query_lens, strict=True)):
        write(req, range(s - q, s))

    seq_lens = torch.tensor(seq_lens_override or batch.seq_lens, dtype=torch.int32)
    query_start_loc = torch.zeros(batch.num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(batch.query_lens).cumsum(0)
    query = torch.cat(inputs.queries)
    output = torch.full_like(query, float("nan"))

    # The step as the metadata builder plans it and forward attends it: both
    # ops must be given the same.
    step = {
        "seq_lens": seq_lens,
        "query_start_loc": query_start_loc,
        "causal": True,
        "dynamic_causal": None,
        "kv_cache_dtype": "auto",
    }
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch.num_reqs,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head,
        dtype=DTYPE,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=enable_kv_split,
        **step,
    )
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        scale=head**-0.5,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=table if read_table is None else read_table,
        softcap=0,
        scheduler_metadata=scheduler_metadata,
        s_aux=None,
        k_scale=1.0,
        v_scale=1.0,
        **step,
    )
    return output, isa


def reference_attention(batch: Batch, inputs: Inputs) -> torch.Tensor:
    """softmax(Q K^T * scale + causal mask) V in float64, per request."""
    group = NUM_HEADS // NUM_KV_HEADS
    outs = []
    for q, k, v, s in zip(
        inputs.queries, inputs.keys, inputs.values, batch.seq_lens, strict=True
    ):
        # vLLM's GQA: query head h reads KV head h // group.
        k64 = k.double().repeat_interleave(group, dim=1)
        v64 = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), k64) / math.sqrt(
            batch.head_size
        )
        # The queries are the last len(q) tokens of the sequence.
        q_pos = torch.arange(s - q.shape[0], s)[:, None]
        allowed = torch.arange(s)[None, :] <= q_pos
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v64))
    return torch.cat(outs)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    # NaN-safe: an unwritten output row (kept NaN) counts as an infinite diff.
    return (a.double() - b.double()).abs().nan_to_num(math.inf).max().item()


def max_diffs(
    label: str, **pairs: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, float]:
    """max_diff of each named pair, printed on one line after ``label``."""
    diffs = {name: max_diff(a, b) for name, (a, b) in pairs.items()}
    print(label, " ".join(f"{name}={d:.2e}" for name, d in diffs.items()))
    return diffs


@pytest.mark.parametrize(("case", "head_size", "threads", "enable_kv_split"), SWEEP)
def test_block16_matches_block32_and_reference(
    case: str, head_size: int, threads: int, enable_kv_split: bool
) -> None:
    seq_lens, query_lens = CASES[case]
    batch = Batch(seq_lens, query_lens, head_size)
    inputs = make_inputs(batch, seed=head_size)
    reference = reference_attention(batch, inputs)

    with torch_threads(threads):
        (out16, isa16), (out32, isa32) = (
            run_cpu_attn(
                batch,
                inputs,
                size,
                shuffled_block_table(batch, size, seed=seed),
                enable_kv_split=enable_kv_split,
            )
            for size, seed in ((16, 1), (NATIVE_BLOCK_SIZE, 2))
        )
    # The point is comparing two different kernels; same isa would prove nothing.
    assert isa16 == "vec16"
    assert isa32 != "vec16"

    d = max_diffs(
        f"{case} head={head_size} threads={threads} split={enable_kv_split} "
        f"{isa16} vs {isa32}:",
        blocks=(out16, out32),
        ref16=(out16, reference),
        ref32=(out32, reference),
    )
    assert d["blocks"] < BLOCK_SIZE_ATOL
    assert d["ref16"] < REFERENCE_ATOL
    assert d["ref32"] < REFERENCE_ATOL


@pytest.mark.parametrize("block_size", [16, NATIVE_BLOCK_SIZE])
def test_wrong_addressing_is_detected(block_size: int) -> None:
    # Negative control: the comparisons above can fail. Reading the right
    # request's blocks in the wrong order, or forgetting the newest tokens, must
    # move the output far beyond the tolerances.
    seq_lens, query_lens = CASES["mixed"]
    batch = Batch(seq_lens, query_lens, 64)
    inputs = make_inputs(batch, seed=7)
    reference = reference_attention(batch, inputs)
    table = shuffled_block_table(batch, block_size, seed=3)

    wrong_table = table.clone()
    # Each request's own blocks in reverse order: in range, so no crash, and
    # blocks holding only stale cache rows get read.
    for row, s in enumerate(batch.seq_lens):
        n = math.ceil(s / block_size)
        wrong_table[row, :n] = table[row, :n].flip(0)
    assert not torch.equal(wrong_table, table)
    # Drop each cached request's newest key (its own token, for the decodes);
    # fresh prefills keep theirs so every query still has a key to attend to.
    short = [s - (s > q) for s, q in zip(seq_lens, query_lens, strict=True)]

    run = functools.partial(
        run_cpu_attn, batch, inputs, block_size, table, enable_kv_split=True
    )
    with torch_threads(1):
        out_table, _ = run(read_table=wrong_table)
        out_lens, _ = run(seq_lens_override=short)
        right, _ = run()
    d = max_diffs(
        f"block={block_size}:",
        right=(right, reference),
        wrong_table=(out_table, reference),
        wrong_seq_lens=(out_lens, reference),
    )
    assert d["right"] < REFERENCE_ATOL
    assert d["wrong_table"] > WRONG_MIN_DIFF
    assert d["wrong_seq_lens"] > WRONG_MIN_DIFF


def test_patch_makes_16_common_block_size() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.worker.utils import select_common_block_size

    # The first call may return False too: conftest's pd_mooncake.register()
    # already patched this process. A repeat must be a no-op either way.
    allow_cpu_attn_block_size_16()
    assert allow_cpu_attn_block_size_16() is False
    assert select_common_block_size(16, [CPUMLABackend, CPUAttentionBackend]) == 16
    # The native size, a multiple of 16, is still accepted as is.
    assert select_common_block_size(32, [CPUAttentionBackend]) == 32


def test_upstream_declaration_has_no_common_block_size() -> None:
    # Negative control for the test above: without our patch, the same call fails.
    stdout, stderr = UPSTREAM.communicate(timeout=120)
    print(stdout)
    assert UPSTREAM.returncode == 0, stderr[-2000:]
    assert "plugins_loaded False" in stdout
    assert "declared [MultipleOf(32)]" in stdout
    assert "ValueError No common block size for 16" in stdout
