"""Tensor parallel on both roles: every rank's KV crosses, whole and verified.

Run on a stack whose servers are tensor-parallel (the twin:
``PD_TENSOR_PARALLEL_SIZE=2``); skipped at TP 1. With the same width N on both
sides upstream pairs prefill rank r with decode rank r, and an MLA model's
every rank holds the whole latent: each request is N transfers, each of the
bytes the layout predicts for one rank (the latent whole, the draft's GQA
heads split), each verified by the KV checksum on its decode rank and sent
through that rank's staging buffer. Prefill's metrics add up the ranks'
(vLLM aggregates the workers' connector stats), so the sums say it.
With different widths (``PD_PREFILL_TENSOR_PARALLEL_SIZE``,
``PD_DECODE_TENSOR_PARALLEL_SIZE``; which pairs serve: pd_mooncake.tp_pairs)
each decode rank pulls its region from one prefill rank: a request is as many
transfers as decode has ranks, each an MLA latent whole.
"""

from __future__ import annotations

import socket

import pytest

from conftest import ModelConfigs, Stack, Widths, staged_descriptors_most
from pdstack import config, kv_layout
from pdstack import metrics as m

LENGTHS = {
    "under-one-block": lambda block: min(5, block - 1),
    "blocks-plus-one": lambda block: 4 * block + 1,
    "many-blocks": lambda block: 12 * block + 8,
}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tp(widths: Widths) -> Widths:
    if max(widths.prefill, widths.decode) < 2:
        pytest.skip(
            f"the stack is not tensor-parallel ({widths}); twin: set "
            "PD_TENSOR_PARALLEL_SIZE=2"
        )
    return widths


def test_each_prefill_rank_listens_on_its_side_channel(
    stack: Stack, tp: Widths
) -> None:
    """pd_mooncake.reliability's fixed port per rank (bootstrap + offset + rank)."""
    if not stack.owned:
        pytest.skip("ports of a stack given by URLs are not known here")
    # Here, not above: it needs zmq, which a client venv (`make client`) lacks.
    from pd_mooncake import reliability

    extra = config.vllm_flags("prefill", "tiny", "cpu")["kv-transfer-config"][
        "kv_connector_extra_config"
    ]
    for rank in range(tp.prefill):
        port = reliability.side_channel_port(
            config.ports().bootstrap,
            int(extra["side_channel_port_offset"]),
            dp_rank=0,
            pp_rank=0,
            tp_rank=rank,
            pp_size=1,
            tp_size=tp.prefill,
        )
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            print(f"[tp] prefill rank {rank}: side channel on {port}")


@pytest.mark.parametrize("name", LENGTHS)
def test_every_rank_sends_its_layout_verified_and_staged(
    stack: Stack,
    layout: kv_layout.KVLayout,
    model_configs: ModelConfigs,
    tp: Widths,
    name: str,
) -> None:
    length = LENGTHS[name](layout.block_size)
    prompt = stack.prompt(length, salt=3000 + length)
    expected = stack.reference_steps(prompt, MAX_TOKENS)
    decode0, prefill0 = m.scrape(stack.decode), m.scrape(stack.prefill)
    checksum = decode0.total(m.CHECKSUM_ENABLED) > 0
    got = stack.answer(prompt, MAX_TOKENS)
    # Each decode rank pulls once; the checksum counts each region of each
    # request on each decode rank.
    ranks = tp.decode
    verified = ranks * layout.layers if checksum else 0
    decode = m.settle(
        stack.decode, decode0, lambda d: d.total(m.CHECKSUM_MATCH) >= verified
    )
    prefill = m.settle(stack.prefill, prefill0, lambda d: d.total(m.TRANSFERS) >= ranks)

    verdict = stack.judge(expected, got, f"TP {tp}: {length}-token prompt")
    assert verdict.ok, verdict.describe()

    tokens = kv_layout.tokens_loaded(length)
    # The layout (decode's width: the conftest fixture) is every decode
    # rank's: one rank's is 1/ranks of it.
    per_rank = layout.transfer_bytes(tokens) // ranks
    per_rank_mla = layout.transfer_bytes(tokens, kv_layout.MLA) // ranks
    regions = prefill.by_label(m.REGION_BYTES, "layout")
    descriptors = prefill.total(m.DESCRIPTORS)
    print(
        f"[tp] {tp}, {length}-token prompt: {prefill.total(m.TRANSFERS):.0f} "
        f"transfers, {prefill.total(m.BYTES):.0f} bytes ({per_rank} per decode "
        f"rank predicted), by layout {regions}, {descriptors:.0f} descriptors, "
        f"decode checksum matches {decode.total(m.CHECKSUM_MATCH):.0f}, staging "
        f"phases {prefill.by_label(m.STAGING_SECONDS, 'phase')} / "
        f"{decode.by_label(m.STAGING_SECONDS, 'phase')}"
    )
    # One transfer per decode rank, no failure, each rank's bytes as predicted.
    assert prefill.total(m.TRANSFERS) == ranks
    assert prefill.total(m.FAILED_TRANSFERS) == 0
    assert prefill.total(m.FAILED_RECVS) == 0
    assert prefill.total(m.BYTES) == ranks * per_rank
    # Each rank receives the whole latent (what one rank sends at TP 1) and
    # its share of a GQA draft's heads.
    one = kv_layout.layout(*model_configs, layout.kv_dtype, layout.block_size, 1)
    assert per_rank_mla == one.transfer_bytes(tokens, kv_layout.MLA)
    assert regions.get(kv_layout.MLA, 0) == ranks * per_rank_mla
    assert regions.get(kv_layout.GQA, 0) == layout.transfer_bytes(tokens, kv_layout.GQA)
    # Each decode rank verified each of its regions.
    assert decode.total(m.CHECKSUM_MATCH) == verified
    assert decode.total(m.CHECKSUM_MISMATCH) == 0
    # Each rank's KV crossed as a staged record: at least one descriptor per
    # rank, at most one rank's record in 1 MiB descriptors per rank.
    most = staged_descriptors_most(length, layout, prefill, tp)
    assert ranks <= descriptors <= most
    assert decode.by_label(m.STAGING_SECONDS, "phase").get("scatter", 0) > 0
