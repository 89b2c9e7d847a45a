"""Which prefill/decode tensor-parallel pairs a P/D stack can serve.

One home for the rule; the GPU preflight (``pdstack.preflight``) asks it
before any server starts, and a handshake can ask it with the peer's figures.

What upstream's Mooncake connector does when the two TP sizes differ (vLLM
0.32.0 and 0.33.0 alike; file:line of both in docs/gpu.md, "Tensor
parallelism"):

- the sizes must divide one another: ``TransferTopology.tp_ratio`` and
  ``_get_tp_ratio`` assert it, in the middle of the first transfer's
  handshake;
- with an MLA model every layer is taken as replicated (``TransferTopology``
  gets ``is_mla=model_config.use_mla``, and the region checks pass
  ``total_num_kv_heads=None`` for MLA): a decode rank copies one prefill
  rank's whole region. Right for the latent, which every rank holds whole;
  wrong for a GQA layer in the same model (an Eagle3 draft), whose KV heads
  *are* split over the ranks: the per-rank sizes differ, and upstream either
  copies half a block into a whole one (prefill TP > decode TP) or trips an
  assert in the sender (prefill TP < decode TP);
- a model without MLA is re-sharded head by head (``get_required_kvcache_layout``
  asks for LBHNC), which this rule leaves to upstream.

And this plugin's KV checksum digests a whole region per rank and compares it
on the paired decode rank, so it needs the same TP on both sides
(``checksum.py`` refuses such pulls; here it is refused before any request).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class GqaLayers:
    """Attention layers of an MLA model that are not MLA (an Eagle3 draft)."""

    name: str
    kv_heads: int


def heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads one rank holds: split over ranks, replicated when fewer."""
    return max(1, kv_heads // tp)


def refusal(
    prefill_tp: int,
    decode_tp: int,
    *,
    mla: bool,
    gqa_layers: Iterable[GqaLayers] = (),
    kv_checksum: bool = False,
) -> str | None:
    """Why prefill TP ``prefill_tp`` cannot feed decode TP ``decode_tp``, naming
    the pair; None when it can. ``mla``: the target model caches an MLA latent;
    ``gqa_layers``: its other (head-split) attention layers."""
    pair = f"prefill TP {prefill_tp} -> decode TP {decode_tp}"
    if prefill_tp < 1 or decode_tp < 1:
        return f"{pair}: a tensor-parallel size is at least 1"
    if prefill_tp == decode_tp:
        return None
    big, small = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    if big % small:
        return (
            f"{pair}: upstream's Mooncake connector needs one size to divide "
            "the other (TransferTopology.tp_ratio asserts it)"
        )
    if kv_checksum:
        return (
            f"{pair}: the KV checksum (kv_checksum) compares each prefill "
            "rank's digest on its paired decode rank, so it needs the same TP "
            "on both sides; set the same tensor-parallel-size, or "
            "kv_checksum false in both roles"
        )
    if mla:
        split = [
            layer
            for layer in gqa_layers
            if heads_per_rank(layer.kv_heads, prefill_tp)
            != heads_per_rank(layer.kv_heads, decode_tp)
        ]
        if split:
            what = ", ".join(
                f"{layer.name} ({layer.kv_heads} KV heads: "
                f"{heads_per_rank(layer.kv_heads, prefill_tp)} per prefill rank, "
                f"{heads_per_rank(layer.kv_heads, decode_tp)} per decode rank)"
                for layer in split
            )
            return (
                f"{pair}: upstream's Mooncake connector copies every layer of "
                "an MLA model whole from one rank to one rank, but the GQA "
                f"layers of {what} are split over the ranks differently on the "
                "two sides"
            )
    return None
