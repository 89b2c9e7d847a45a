"""Tensor-parallel ranks on both sides, between real Mooncake engines.

Each rank is a PDMooncakeConnectorWorker with its own TransferEngine and its
own caches: prefill's ranks here (one engine each), decode's each in a
process of its own. As on a real TP stack, every rank holds the MLA latent
whole (the same bytes on each prefill rank) and its share of the Eagle
draft's GQA heads. Decode rank d asks the prefill ranks upstream's
``TransferTopology`` names; each plans and sends with the worker's own
addressing (upstream's heterogeneous-TP planner, PR #36869).

- TP 2 -> TP 2: each decode rank gets its own prefill rank's blocks, both
  layouts, byte-identical, nothing else touched.
- TP 2 -> TP 1 (MLA latent): only prefill rank 0 sends; decode's latent is
  byte-identical. The draft's heads, split differently, are not: what
  pd_mooncake.tp_pairs refuses, shown on real bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch
from deadlines import SPAWN_DEADLINE_S
from test_tp_pairs import topology
from test_transfer import build_send, connector_worker, pull_metadata
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from bench.loopback import Peer
from conftest import DRAFT_LAYER, MLA_LAYER
from pd_mooncake import tp_pairs
from pd_mooncake.tp_pairs import GqaLayers

BLOCKS = 4  # logical blocks of 16 tokens (one kernel block each)
LATENT = 96
DRAFT_HEADS, HEAD = 8, 64  # K and V halves of 4 KV heads, as conftest's draft
PREFILL_BLOCKS = [1, 3]
DECODE_BLOCKS = [0, 2]


def shapes(tp: int) -> dict[str, tuple[int, ...]]:
    return {
        MLA_LAYER: (BLOCKS, 16, LATENT),
        DRAFT_LAYER: (BLOCKS, 16, DRAFT_HEADS // tp, HEAD),
    }


def rank_worker(
    caches: dict[str, torch.Tensor], rank: int, size: int, consumer: bool
) -> tuple[Any, Any]:
    worker, engine = connector_worker(caches, consumer=consumer, backport=True)
    worker.tp_rank, worker.tp_size = rank, size
    # Upstream's own topology: MLA, so every layer counts as replicated.
    worker.transfer_topo = topology(rank, size)
    return worker, engine


class DecodeRank:
    """One decode rank in its own process: zeroed caches, registered."""

    def __init__(self, rank: int, size: int) -> None:
        self.caches = {n: torch.zeros(s) for n, s in shapes(size).items()}
        self.worker, self.engine = rank_worker(self.caches, rank, size, True)

    def metadata(self) -> bytes:
        blocks = [DECODE_BLOCKS, DECODE_BLOCKS]
        return msgspec.msgpack.encode(pull_metadata(self.worker, blocks))

    def read(self) -> dict[str, bytes]:
        return {n: c.numpy().tobytes() for n, c in self.caches.items()}


def prefill_caches(size: int) -> list[dict[str, torch.Tensor]]:
    """Each prefill rank's caches: the same latent, its slice of the heads."""
    generator = torch.Generator().manual_seed(7)
    latent = torch.randn(shapes(1)[MLA_LAYER], generator=generator)
    heads = torch.randn(shapes(1)[DRAFT_LAYER], generator=generator)
    share = DRAFT_HEADS // size
    return [
        {
            MLA_LAYER: latent.clone(),
            DRAFT_LAYER: heads[:, :, r * share : (r + 1) * share].clone(),
        }
        for r in range(size)
    ]


def send(worker: Any, engine: Any, meta: upstream.MooncakeXferMetadata) -> int:
    """What prefill rank ``worker`` sends for decode's pull; its byte count.
    A send that cannot be built fails the request (SendFailedError: why)."""
    src, dst, lens, err_reqs, err_msg = build_send(worker, meta, PREFILL_BLOCKS)
    if err_msg is not None:
        raise SendFailedError(f"{err_reqs} failed: {err_msg}")
    if src:
        worker.engine = engine.engine
        session = f"{meta.remote_hostname}:{meta.remote_port}"
        assert worker._send_blocks(session, src, dst, lens) == 0
    return sum(lens)


class SendFailedError(Exception):
    pass


def pull(prefill_tp: int, decode_tp: int) -> tuple[list[dict], list[dict], list]:
    """Every decode rank pulls from the prefill ranks upstream pairs it with;
    returns (prefill caches, decode caches, bytes sent per (p, d) rank)."""
    sent = prefill_caches(prefill_tp)
    workers = [rank_worker(c, r, prefill_tp, False) for r, c in enumerate(sent)]
    received, moved = [], []
    for d in range(decode_tp):
        with Peer(DecodeRank, d, decode_tp, deadline_s=SPAWN_DEADLINE_S) as rank:
            meta = msgspec.msgpack.decode(
                rank.call("metadata"), type=upstream.MooncakeXferMetadata
            )
            for p in topology(d, decode_tp).handshake_target_ranks(prefill_tp):
                moved.append((p, d, send(*workers[p], meta)))
            received.append(
                {
                    n: torch.frombuffer(bytearray(raw), dtype=torch.float32).view(
                        shapes(decode_tp)[n]
                    )
                    for n, raw in rank.call("read").items()
                }
            )
    return sent, received, moved


def landed(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """dst's DECODE_BLOCKS hold src's PREFILL_BLOCKS, dst's other blocks zero."""
    others = [b for b in range(BLOCKS) if b not in DECODE_BLOCKS]
    return torch.equal(dst[DECODE_BLOCKS], src[PREFILL_BLOCKS]) and not bool(
        torch.count_nonzero(dst[others])
    )


def test_tp2_to_tp2_each_rank_gets_its_own_rank_whole() -> None:
    assert tp_pairs.refusal(2, 2, mla=True, gqa_layers=[GqaLayers("draft", 4)]) is None
    sent, received, moved = pull(2, 2)
    block = {n: torch.zeros(s[1:]).nbytes for n, s in shapes(2).items()}
    per_rank = sum(block.values()) * len(PREFILL_BLOCKS)
    print(f"TP 2 -> 2: bytes per (prefill, decode) rank {moved}")
    assert moved == [(0, 0, per_rank), (1, 1, per_rank)]
    for d in range(2):
        for name in shapes(2):
            assert landed(sent[d][name], received[d][name]), (d, name)


def test_tp2_to_tp1_the_latent_lands_whole_the_split_draft_does_not() -> None:
    sent, received, moved = pull(2, 1)
    latent = torch.zeros(shapes(1)[MLA_LAYER][1:]).nbytes * len(PREFILL_BLOCKS)
    draft = torch.zeros(shapes(2)[DRAFT_LAYER][1:]).nbytes * len(PREFILL_BLOCKS)
    print(f"TP 2 -> 1: bytes per (prefill, decode) rank {moved}")
    # Upstream: prefill rank 0 sends its whole regions, rank 1 nothing.
    assert moved == [(0, 0, latent + draft), (1, 0, 0)]
    (got,) = received
    assert landed(sent[0][MLA_LAYER], got[MLA_LAYER])
    # Decode's draft should hold both prefill ranks' heads side by side; it
    # holds rank 0's half-size blocks' bytes at the start of each block.
    whole = torch.cat([sent[0][DRAFT_LAYER], sent[1][DRAFT_LAYER]], dim=2)
    assert not landed(whole, got[DRAFT_LAYER])
    # Which is why the rule refuses this pair for a model with that draft.
    why = tp_pairs.refusal(2, 1, mla=True, gqa_layers=[GqaLayers("draft", 4)])
    assert why is not None and "draft" in why


def test_tp1_to_tp2_upstream_asserts_on_the_split_draft() -> None:
    """Decode wider: prefill's one rank would copy its whole draft block into
    each decode rank's half-size one; upstream's sender asserts, and the
    plugin fails the request with upstream's reason."""
    with pytest.raises(SendFailedError, match="exceeds remote KV block size"):
        pull(1, 2)
