"""Evidence that each request's KV crossed from prefill to decode.

Decode: the prompt's tokens counted as loaded from an external KV transfer,
none computed locally. Prefill: this plugin's transfer metrics show one
successful transfer per decode rank (tensor parallel: each pulls its own
copy), no failures, the bytes the model's KV layout predicts, and bytes in
every region layout the stack's models have (an Eagle3 draft's GQA as well
as the MLA target's), none in another.
"""

from __future__ import annotations

import pytest

from conftest import Stack, Widths, staged_descriptors_most
from pdstack import client, kv_layout
from pdstack import metrics as m

# Prompt lengths in blocks of the stack's own size: under one block, exactly
# one, two and a token, and many.
LENGTHS = {
    "under-one-block": lambda block: min(5, block - 1),
    "one-block": lambda block: block,
    "two-blocks-plus-one": lambda block: 2 * block + 1,
    "many-blocks": lambda block: 12 * block + 8,
}


@pytest.fixture(scope="module", params=list(LENGTHS))
def sent(
    request: pytest.FixtureRequest,
    stack: Stack,
    layout: kv_layout.KVLayout,
    widths: Widths,
) -> tuple[int, m.Snapshot, m.Snapshot]:
    """One request of each length through the router, read by both sides'
    tests: its length and the (decode, prefill) metric deltas."""
    length = LENGTHS[request.param](layout.block_size)
    prompt = stack.prompt(length, salt=1000 + length)
    decode0, prefill0 = m.scrape(stack.decode), m.scrape(stack.prefill)
    staged = decode0.total(m.STAGING_BYTES) > 0
    client.complete(stack.router, prompt, max_tokens=8)
    decode = m.settle(
        stack.decode,
        decode0,
        lambda d: (
            d.total(m.PROMPT_TOKENS_BY_SOURCE) >= len(prompt)
            and (not staged or d.total(m.STAGING_SECONDS) > 0)
        ),
    )
    prefill = m.settle(
        stack.prefill, prefill0, lambda d: d.total(m.TRANSFERS) >= widths.decode
    )
    return length, decode, prefill


def test_decode_loads_the_prompt_from_prefill(
    sent: tuple[int, m.Snapshot, m.Snapshot],
) -> None:
    length, decode, _ = sent
    by_source = decode.by_label(m.PROMPT_TOKENS_BY_SOURCE, "source")
    external = decode.total(m.EXTERNAL_HITS)
    print(
        f"{length}-token prompt: decode sources {by_source}, external hits {external}"
    )
    loaded = kv_layout.tokens_loaded(length)
    assert by_source.get("external_kv_transfer", 0) == loaded
    assert external == loaded
    assert by_source.get("local_compute", 0) == length - loaded


def test_prefill_transfer_metrics(
    sent: tuple[int, m.Snapshot, m.Snapshot],
    layout: kv_layout.KVLayout,
    widths: Widths,
) -> None:
    length, _, prefill = sent
    regions = prefill.by_label(m.REGION_BYTES, "layout")
    tokens = kv_layout.tokens_loaded(length)
    expected = layout.transfer_bytes(tokens)
    print(
        f"{length}-token prompt: {prefill.total(m.TRANSFERS):.0f} transfer(s), "
        f"{prefill.total(m.BYTES):.0f} bytes (layout predicts {expected}), "
        f"by layout {regions}"
    )
    assert prefill.total(m.TRANSFERS) == widths.decode
    assert prefill.total(m.FAILED_TRANSFERS) == 0
    assert prefill.total(m.FAILED_RECVS) == 0
    assert prefill.total(m.BYTES) == expected
    # Each layout the models have, at its own size; none other.
    kinds = {r.layout for r in layout.regions}
    for kind in (kv_layout.MLA, kv_layout.GQA):
        assert regions.get(kind, 0) == layout.transfer_bytes(tokens, kind), kind
        assert (regions.get(kind, 0) > 0) == (kind in kinds), kind


def test_a_staged_transfer_takes_few_descriptors(
    sent: tuple[int, m.Snapshot, m.Snapshot],
    stack: Stack,
    layout: kv_layout.KVLayout,
    widths: Widths,
) -> None:
    """With a staging buffer on both servers (pd_mooncake.staging) the
    request's KV crosses as one record in 1 MiB descriptors: a header naming
    at most one descriptor per block and region, then the bytes. Without it
    upstream sends at least one descriptor per region (9 here)."""
    staged = [m.scrape(u).total(m.STAGING_BYTES) for u in (stack.prefill, stack.decode)]
    if not all(staged):
        pytest.skip(f"KV staging is off on this stack (buffer bytes {staged})")
    length, decode, prefill = sent
    # Prefill gathered and wrote a record, decode copied it into the blocks.
    sent_phases = prefill.by_label(m.STAGING_SECONDS, "phase")
    assert sent_phases.get("gather", 0) > 0 and sent_phases.get("write", 0) > 0
    assert decode.by_label(m.STAGING_SECONDS, "phase").get("scatter", 0) > 0
    most = staged_descriptors_most(length, layout, prefill, widths)
    descriptors = prefill.total(m.DESCRIPTORS)
    print(f"{length}-token prompt: {descriptors:.0f} descriptors, at most {most}")
    assert widths.decode <= descriptors <= most


# A burst of mixed prompts before the long one: the free block lists
# fragment, so its blocks are scattered (the direct path's worst case).
BURST = (37, 300, 1000, 64, 2500, 7)


def test_a_prompt_at_max_model_len_goes_staged_on_a_fragmented_cache(
    stack: Stack, layout: kv_layout.KVLayout, widths: Widths
) -> None:
    """Staging on, the longest prompt the stack serves crosses staged, never
    directly (pd_mooncake.late_writes): prefill gathered and wrote a record
    in at most the record's 1 MiB chunks, decode copied it into its blocks,
    nothing failed, and decode computed only the last token."""
    staged = [m.scrape(u).total(m.STAGING_BYTES) for u in (stack.prefill, stack.decode)]
    if not all(staged):
        pytest.skip(f"KV staging is off on this stack (buffer bytes {staged})")
    max_tokens = 4
    length = client.max_model_len(stack.decode) - max_tokens
    client.complete_all(
        stack.router,
        [stack.prompt(n, salt=2000 + n) for n in BURST],
        max_tokens=max_tokens,
    )
    decode0, prefill0 = m.scrape(stack.decode), m.scrape(stack.prefill)
    client.complete(stack.router, stack.prompt(length, salt=3000), max_tokens)
    decode = m.settle(
        stack.decode,
        decode0,
        lambda d: (
            d.total(m.PROMPT_TOKENS_BY_SOURCE) >= length
            and d.total(m.STAGING_SECONDS) > 0
        ),
    )
    prefill = m.settle(
        stack.prefill, prefill0, lambda d: d.total(m.TRANSFERS) >= widths.decode
    )
    sent_phases = prefill.by_label(m.STAGING_SECONDS, "phase")
    loaded = kv_layout.tokens_loaded(length)
    entries = layout.blocks(loaded) * layout.layers
    most = staged_descriptors_most(length, layout, prefill, widths)
    descriptors = prefill.total(m.DESCRIPTORS)
    print(
        f"{length}-token prompt after a burst: {descriptors:.0f} descriptors "
        f"(staged: at most {most}; {entries} blocks x regions), phases "
        f"{sent_phases}, decode {decode.by_label(m.STAGING_SECONDS, 'phase')}"
    )
    assert prefill.total(m.TRANSFERS) == widths.decode
    assert prefill.total(m.FAILED_TRANSFERS) == 0
    assert decode.total(m.FAILED_RECVS) == 0
    assert sent_phases.get("gather", 0) > 0 and sent_phases.get("write", 0) > 0
    assert decode.by_label(m.STAGING_SECONDS, "phase").get("scatter", 0) > 0
    assert widths.decode <= descriptors <= most
    by_source = decode.by_label(m.PROMPT_TOKENS_BY_SOURCE, "source")
    assert by_source.get("external_kv_transfer", 0) == loaded
