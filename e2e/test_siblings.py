"""One API request, several engine requests: a batch of prompts, n > 1.

vllm-router gives the API request one transfer id and vLLM splits it into an
engine request per prompt and per child, all carrying that id. Without the
plugin's per-request ids (pd_mooncake.reliability.sibling_transfer_id), a
batch's second prompt was decoded from the first prompt's KV: wrong tokens,
every metric saying success (measured on this twin before the fix). Here each
prompt's output must equal its own colocated reference, and decode must have
loaded every engine request's prompt from prefill.
"""

from __future__ import annotations

from conftest import TRACE, Stack
from faults_helpers import counters, transferred
from pdstack import client, kv_layout, oracle
from pdstack import metrics as m

MAX_TOKENS = 12


def test_each_prompt_of_a_batch_is_decoded_from_its_own_kv(
    stack: Stack, layout: kv_layout.KVLayout
) -> None:
    # Distinct lengths (distinct KV sizes), and one prompt twice.
    a, b, c = (stack.prompt(n, salt=4100 + n) for n in (21, 48, 70))
    batch = [a, b, a, c]
    expected = [stack.reference_steps(p, MAX_TOKENS) for p in batch]
    distinct = {tuple(s.token for s in e) for e in expected}
    assert len(distinct) == 3, "prompts must differ in output"
    before = counters(stack)
    # Judged on log-probabilities, asked for as every judged answer is.
    done = client.complete_all(stack.router, batch, MAX_TOKENS, **TRACE)
    assert all(c.top_logprobs is not None for c in done), done
    got = [oracle.steps(c.token_ids, c.top_logprobs or []) for c in done]
    tokens = sum(kv_layout.tokens_loaded(len(p)) for p in batch)
    # Every engine request's own blocks, not one prompt's KV four times.
    moved = sum(layout.transfer_bytes(kv_layout.tokens_loaded(len(p))) for p in batch)
    decode, prefill = transferred(
        stack, before, tokens, m.PROMPT_TOKENS_BY_SOURCE, (m.BYTES, moved)
    )
    sources = decode.by_label(m.PROMPT_TOKENS_BY_SOURCE, "source")
    wrong = [
        (i, v.describe())
        for i, (g, e) in enumerate(zip(got, expected, strict=True))
        if not (v := stack.judge(e, g, f"batch prompt {i}")).ok
    ]
    print(
        f"batch of {len(batch)}: wrong {wrong}; decode sources {sources}; prefill "
        f"{prefill.total(m.TRANSFERS):.0f} transfer(s), {prefill.total(m.BYTES):.0f} "
        f"bytes"
    )
    assert wrong == []
    assert sources.get("external_kv_transfer", 0) == tokens
    assert sources.get("local_compute", 0) == sum(len(p) for p in batch) - tokens
    assert prefill.total(m.BYTES) == moved
    assert prefill.total(m.FAILED_TRANSFERS) == 0
    assert prefill.total(m.EXPIRED) == 0


def test_n_children_each_pull_their_own_copy(
    stack: Stack, layout: kv_layout.KVLayout
) -> None:
    """n=3 over a batch of 2 prompts: six engine requests per leg. Sampled
    output has no reference; the evidence is that all six arrive, each
    loaded its prompt from prefill, and nothing failed or expired."""
    prompts = [stack.prompt(n, salt=4200 + n) for n in (30, 45)]
    before = counters(stack)
    got = client.complete_all(
        stack.router, prompts, MAX_TOKENS, n=3, temperature=1.0, seed=11
    )
    loaded = [kv_layout.tokens_loaded(len(p)) for p in prompts]
    tokens = 3 * sum(loaded)
    per_copy = sum(map(layout.transfer_bytes, loaded))
    decode, prefill = transferred(
        stack, before, tokens, m.PROMPT_TOKENS_BY_SOURCE, (m.BYTES, 3 * per_copy)
    )
    sources = decode.by_label(m.PROMPT_TOKENS_BY_SOURCE, "source")
    print(
        f"n=3 x 2 prompts: {len(got)} choices; decode sources {sources}; prefill "
        f"{prefill.total(m.BYTES):.0f} bytes, expired {prefill.total(m.EXPIRED):.0f}"
    )
    assert len(got) == 6
    assert all(len(c.token_ids) == MAX_TOKENS for c in got)
    assert sources.get("external_kv_transfer", 0) == tokens
    assert sources.get("local_compute", 0) == 3 * sum(map(len, prompts)) - tokens
    assert prefill.total(m.BYTES) == 3 * per_copy
    assert prefill.total(m.FAILED_TRANSFERS) == 0
    assert prefill.total(m.EXPIRED) == 0
    assert decode.total(m.FAILED_RECVS) == 0
