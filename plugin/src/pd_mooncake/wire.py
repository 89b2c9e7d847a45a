"""The side channel's messages with the plugin's fields, in one place.

Upstream's msgspec decoders ignore fields they do not know, so decode's pull
and prefill's answer carry the plugin's additions to a peer without the
plugin unharmed; the plugin's decoders read both. Each feature adds its
fields when a message is encoded (``Encoder``): the KV checksum
(pd_mooncake.checksum), the staging path (pd_mooncake.staging) and the KV
geometry (pd_mooncake.geometry).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)


class XferMetadata(upstream.MooncakeXferMetadata, omit_defaults=True):
    """Decode's pull: whether it wants digests and of which scheme (prefill
    refuses a pull that disagrees), and the staging span it offers for this
    pull's KV."""

    pd_kv_checksum: bool = False
    # kv_digest.SCHEME of the digests decode computes (0: a plugin from
    # before the field, whose digests are scheme 1).
    pd_kv_digest_scheme: int = 0
    # [address, bytes, nonce] of decode's span (staging.Offer.wire).
    pd_staging: list[int] | None = None
    # A request too long for one span, pulled in chunks: per request
    # [start, stop, last] of its block positions (staging.Chunk.wire).
    pd_chunk: dict[str, list[int]] | None = None
    # Decode's KV geometry (geometry.Geometry.wire): prefill refuses a pull
    # whose geometry it cannot honour.
    pd_geometry: dict[str, Any] | None = None


class XferResponse(upstream.MooncakeXferResponse, omit_defaults=True):
    """Prefill's answer with, per request in ``ok_reqs``, one digest per
    registered region (prefill's order; ``pd_kv_regions`` names them), and
    whether a staged send of this pull resent descriptors (an earlier
    submission may still land in the span: decode must not reuse it)."""

    pd_kv_digests: dict[str, list[int | None]] | None = None
    pd_kv_regions: list[str] | None = None
    # kv_digest.SCHEME of pd_kv_digests (0: a plugin from before the field).
    pd_kv_digest_scheme: int = 0
    pd_staging_unsettled: bool = False
    # Offset in decode's span of the record holding ``ok_reqs``' KV (absent:
    # sent directly into the blocks, unless ``pd_staging_empty``).
    pd_staging_record: int | None = None
    # A staged pull's ``ok_reqs`` needed no bytes from this prefill worker
    # (upstream's planner has another rank send them: a split pull, e.g. an
    # MLA latent from prefill TP 2 to decode TP 1): nothing was written.
    pd_staging_empty: bool = False
    # Prefill's KV geometry, in its first answer to a decode worker.
    pd_geometry: dict[str, Any] | None = None


# Fields a feature adds: to a pull (no argument) or to an answer (the answer).
PullFields = Callable[[], dict[str, Any]]
AnswerFields = Callable[[Any], dict[str, Any]]


class Encoder:
    """Upstream's encoder, adding each feature's fields to pulls and answers."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pull_fields: list[PullFields] = []
        self.answer_fields: list[AnswerFields] = []

    def encode(self, obj: Any) -> bytes:
        if type(obj) is upstream.MooncakeXferMetadata:
            fields = _merged(f() for f in self.pull_fields)
            if fields:
                obj = XferMetadata(**msgspec.structs.asdict(obj), **fields)
        elif type(obj) is upstream.MooncakeXferResponse:
            fields = _merged(f(obj) for f in self.answer_fields)
            if fields:
                obj = XferResponse(**msgspec.structs.asdict(obj), **fields)
        return self.inner.encode(obj)


def _merged(parts: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        out.update(part)
    return out


def install(worker: Any) -> Encoder:
    """The worker's encoder and decoders, once (either feature may come first)."""
    if not isinstance(worker._encoder, Encoder):
        worker._encoder = Encoder(worker._encoder)
        # Both decoders tolerate either side's messages: a prefill with the
        # checksum off still reads (and refuses) a decode that wants digests.
        worker._xfer_meta_decoder = msgspec.msgpack.Decoder(XferMetadata)
        worker._xfer_resp_decoder = msgspec.msgpack.Decoder(XferResponse)
    return worker._encoder
