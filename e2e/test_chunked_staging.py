"""A prompt longer than one KV staging span crosses in chunks, staged, and
its answer equals the colocated reference token for token.

Runs on a twin whose staging buffer is small (``make test-chunked``:
PD_MOONCAKE_KV_STAGING_MIB on both roles), so that a prompt the twin serves
needs several spans; skipped on any other stack. Prefill counts one
transfer per chunk: exactly the chunks the plugin's span bound predicts for
the stack's KV layout, none failed, and decode's checksum passes over the
whole request.
"""

from __future__ import annotations

import os

import pytest

from conftest import Stack
from pd_mooncake import staging
from pdstack import kv_layout
from pdstack import metrics as m

KV_STAGING_MIB = 2
LENGTH = 2100  # over one span of 2 MiB on the tiny pair: several chunks
MAX_TOKENS = 16

pytestmark = pytest.mark.skipif(
    os.environ.get("PD_MOONCAKE_KV_STAGING_MIB") != str(KV_STAGING_MIB),
    reason=f"needs PD_MOONCAKE_KV_STAGING_MIB={KV_STAGING_MIB} (make test-chunked)",
)


def predicted_chunks(layout: kv_layout.KVLayout, tokens: int) -> int:
    """Chunks of a pull of ``tokens`` by the plugin's span bound (one
    registered region per layer, as the preflight counts them)."""
    block_bytes = [
        r.bytes_per_token * layout.block_size
        for r in layout.regions
        for _ in range(r.layers)
    ]
    per_chunk = staging.chunk_blocks(KV_STAGING_MIB << 20, block_bytes)
    return -(-layout.blocks(tokens) // per_chunk)


def test_a_prompt_over_one_span_crosses_in_chunks_and_answers_exactly(
    stack: Stack, layout: kv_layout.KVLayout
) -> None:
    chunks = predicted_chunks(layout, kv_layout.tokens_loaded(LENGTH))
    assert chunks >= 2, "the prompt fits one span: nothing chunked"
    prompt = stack.prompt(LENGTH, salt=4242)
    expected = stack.reference_steps(prompt, MAX_TOKENS)
    decode0, prefill0 = m.scrape(stack.decode), m.scrape(stack.prefill)
    got = stack.answer(prompt, MAX_TOKENS)
    verdict = stack.judge(expected, got, f"{LENGTH}-token prompt in chunks")
    prefill = m.settle(
        stack.prefill, prefill0, lambda d: d.total(m.TRANSFERS) >= chunks
    )
    decode = m.settle(stack.decode, decode0, lambda d: d.total(m.CHECKSUM_MATCH) > 0)
    print(
        f"{LENGTH}-token prompt: {prefill.total(m.TRANSFERS):.0f} transfers "
        f"(predicted {chunks} chunks), {prefill.total(m.DESCRIPTORS):.0f} "
        f"descriptors, {prefill.total(m.BYTES):.0f} bytes; {verdict.describe()}"
    )
    assert verdict.ok, verdict.describe()
    assert decode0.total(m.STAGING_BYTES) == KV_STAGING_MIB << 20
    assert prefill.total(m.TRANSFERS) == chunks
    assert prefill.total(m.FAILED_TRANSFERS) == 0
    assert decode.total(m.FAILED_RECVS) == 0
    assert decode.total(m.CHECKSUM_MISMATCH) == 0
    # Every byte of the request, once: chunks cover the blocks exactly.
    assert prefill.total(m.BYTES) == layout.transfer_bytes(
        kv_layout.tokens_loaded(LENGTH)
    )
