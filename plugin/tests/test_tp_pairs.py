"""The TP pair rule (pd_mooncake.tp_pairs), each way, and grounded in upstream:
for every pair it accepts, upstream's own planner (vLLM's Mooncake connector)
gives each decode rank one prefill rank's whole region, of the size decode
registered; for every pair it refuses on the layout, upstream's planner does
not (or asserts)."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from pd_mooncake import tp_pairs
from pd_mooncake.tp_pairs import GqaLayers

# The tiny profile's Eagle3 draft (pdstack.tiny_model): 2 KV heads of 64.
TINY_DRAFT = GqaLayers("draft", 2)
# Bytes of one block of one layer per rank: an MLA latent (whole on every
# rank) and one GQA KV head.
LATENT_BLOCK = 16 * 576 * 4
HEAD_BLOCK = 16 * 2 * 64 * 4


def topology(rank: int, size: int) -> TransferTopology:
    return TransferTopology(
        tp_rank=rank,
        tp_size=size,
        block_size=16,
        engine_id=f"e{size}",
        is_mla=True,
        is_mamba=False,
        total_num_kv_heads=1,
        attn_backends=[],
    )


def upstream_copies(
    prefill_tp: int, decode_tp: int, layer: GqaLayers | None
) -> list[tuple[int, int]]:
    """Per decode rank: (bytes upstream copies into one block of one layer,
    bytes that block holds), as upstream plans an MLA model's transfer: decode
    asks the prefill ranks its topology names, each plans its copy."""

    def block(tp: int) -> int:
        if layer is None:
            return LATENT_BLOCK
        return tp_pairs.heads_per_rank(layer.kv_heads, tp) * HEAD_BLOCK

    out = []
    for d_rank in range(decode_tp):
        copied = 0
        for p_rank in topology(d_rank, decode_tp).handshake_target_ranks(prefill_tp):
            send, src, dst, length = upstream._compute_sender_transfer_plan(
                local_tp_rank=p_rank,
                local_tp_size=prefill_tp,
                remote_tp_rank=d_rank,
                remote_tp_size=decode_tp,
                local_kv_block_len=block(prefill_tp),
                remote_kv_block_len=block(decode_tp),
                # What upstream passes for an MLA model: is_mla, no head count.
                producer_cache_replicated=True,
                total_num_kv_heads=None,
            )
            # A whole copy starts at the start of both blocks.
            copied += length if send and src == dst == 0 else 0
        out.append((copied, block(decode_tp)))
    return out


PAIRS = [(1, 1), (2, 2), (1, 2), (2, 1), (1, 4), (4, 2), (2, 8), (8, 1)]


@pytest.mark.parametrize(("p", "d"), PAIRS)
def test_mla_latent_pairs_are_accepted_and_upstream_copies_whole(p: int, d: int):
    assert tp_pairs.refusal(p, d, mla=True) is None
    assert upstream_copies(p, d, None) == [(LATENT_BLOCK, LATENT_BLOCK)] * d


@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1), (1, 4), (4, 1)])
def test_mla_with_split_gqa_draft_is_refused_where_upstream_miscopies(p: int, d: int):
    why = tp_pairs.refusal(p, d, mla=True, gqa_layers=[TINY_DRAFT])
    assert why is not None
    assert f"prefill TP {p} -> decode TP {d}" in why and "draft (2 KV heads" in why
    try:
        copies = upstream_copies(p, d, TINY_DRAFT)
    except AssertionError:
        return  # upstream's sender asserts (a copy larger than decode's block)
    assert any(copied != held for copied, held in copies), copies


@pytest.mark.parametrize(("p", "d"), [(2, 2), (4, 8), (8, 4)])
def test_gqa_draft_split_alike_on_both_sides_is_accepted(p: int, d: int):
    # 2 KV heads over 4 or 8 ranks: one (replicated) head per rank either side.
    assert tp_pairs.refusal(p, d, mla=True, gqa_layers=[TINY_DRAFT]) is None
    assert all(c == h for c, h in upstream_copies(p, d, TINY_DRAFT))


@pytest.mark.parametrize(("p", "d"), [(2, 3), (3, 2), (4, 6)])
def test_sizes_that_do_not_divide_are_refused_as_upstream_asserts(p: int, d: int):
    why = tp_pairs.refusal(p, d, mla=True)
    assert why is not None and "divide" in why and f"TP {p} -> decode TP {d}" in why
    with pytest.raises(AssertionError):
        upstream._get_tp_ratio(p, d)


def test_checksum_needs_the_same_tp():
    assert tp_pairs.refusal(2, 2, mla=True, kv_checksum=True) is None
    why = tp_pairs.refusal(1, 2, mla=True, kv_checksum=True)
    assert why is not None and "kv_checksum" in why


def test_a_size_below_one_is_refused():
    assert tp_pairs.refusal(0, 1, mla=True) is not None
