"""The KV geometry comparison (pd_mooncake.geometry): every field, which
differences the transfer honours, and prefill's refusal of a pull on a real
registered connector worker (real TransferEngine, real ZMQ-encoded
messages). The real-server cases are test_geometry_servers.py."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
from test_transfer import build_send
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from conftest import DRAFT_LAYER, MLA_LAYER, RecordingEngine, make_worker, mixed_caches
from pd_mooncake import faults, geometry, wire
from pd_mooncake.connector import PDMooncakeConnectorWorker
from pd_mooncake.geometry import Geometry, Region, compare
from pd_mooncake.metric_names import GQA_LAYOUT, MLA_LAYOUT

TARGET = tuple(
    Region(f"model.layers.{i}.self_attn.attn", MLA_LAYOUT, 36864, 1, "float32")
    for i in range(8)
)
DRAFT = Region("model.layers.8.self_attn.attn", GQA_LAYOUT, 16384, 2, "float32")
# The tiny profile's prefill, as it states itself at start-up.
TINY = Geometry(
    block_size=16,
    kernel_block_size=16,
    kv_dtype="float32",
    tp_rank=0,
    tp_size=1,
    pp_size=1,
    draft="eagle3:draft",
    num_speculative_tokens=2,
    regions=(*TARGET, DRAFT),
)


def change(g: Geometry = TINY, **fields: Any) -> Geometry:
    return dataclasses.replace(g, **fields)


def scaled(g: Geometry, factor: float, dtype: str | None = None) -> Geometry:
    """``g`` with every region's bytes per block scaled (and its dtype)."""
    return change(
        g,
        regions=tuple(
            dataclasses.replace(
                r,
                bytes_per_block=int(r.bytes_per_block * factor),
                dtype=dtype or r.dtype,
            )
            for r in g.regions
        ),
    )


def refused(p: Geometry, d: Geometry) -> list[str]:
    return [x.what for x in compare(p, d).refused]


def honoured(p: Geometry, d: Geometry) -> list[str]:
    return [x.what for x in compare(p, d).honoured]


# -- the comparison --------------------------------------------------------------
def test_same_geometry_proceeds_without_a_word() -> None:
    verdict = compare(TINY, change(tp_rank=0))
    assert verdict.differences == ()
    assert verdict.refusal is None


def test_block_size_refused_naming_the_flag_and_nothing_it_causes() -> None:
    # 32-token blocks: twice the bytes per block in every region, which is
    # the block size's doing, not a second difference.
    decode = scaled(change(block_size=32, kernel_block_size=32), 2)
    verdict = compare(TINY, decode)
    assert refused(TINY, decode) == ["block size"]
    assert verdict.refusal == (
        "KV geometry differs: block size: prefill 16, decode 32; set "
        f"{geometry.FLAG_BLOCK_SIZE} the same on both roles"
    )


def test_logical_block_size_refused_even_with_the_same_kernel_blocks() -> None:
    """32-token logical blocks over 16-token kernel blocks: every region's
    bytes per (kernel) block are the same, yet upstream pairs the two block
    lists position by position and converts decode's ids with prefill's
    ratio: refused."""
    decode = change(block_size=32)
    assert refused(TINY, decode) == ["block size"]


def test_kernel_block_size_refused_naming_the_backend() -> None:
    decode = scaled(change(kernel_block_size=32), 2)
    verdict = compare(TINY, decode)
    assert refused(TINY, decode) == ["kernel block size"]
    assert geometry.FLAG_KERNEL in (verdict.refusal or "")


def test_kv_dtype_refused_naming_the_flag() -> None:
    decode = scaled(change(kv_dtype="bfloat16"), 0.5, "bfloat16")
    verdict = compare(TINY, decode)
    assert refused(TINY, decode) == ["KV dtype"]
    assert "prefill float32, decode bfloat16" in (verdict.refusal or "")
    assert geometry.FLAG_KV_DTYPE in (verdict.refusal or "")


def test_same_size_dtypes_refused() -> None:
    """fp8_e4m3 and fp8_e5m2 take the same bytes (upstream's length checks
    pass): the dtype alone refuses."""
    p = change(kv_dtype="fp8_e4m3")
    assert refused(p, change(kv_dtype="fp8_e5m2")) == ["KV dtype"]


def test_region_dtype_refused_where_the_kv_dtype_agrees() -> None:
    """kv_cache_dtype_skip_layers can leave one layer in another dtype."""
    regions = (*TARGET[:-1], dataclasses.replace(TARGET[-1], dtype="bfloat16"), DRAFT)
    assert refused(TINY, change(regions=regions)) == [f"dtype of {TARGET[-1].layer}"]


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_side_without_the_draft_refused(side: str) -> None:
    bare = change(draft=None, num_speculative_tokens=0, regions=TARGET)
    p, d = (bare, TINY) if side == "prefill" else (TINY, bare)
    verdict = compare(p, d)
    # The draft's missing layer is the draft's doing, not listed again.
    assert refused(p, d) == ["draft"]
    assert geometry.FLAG_DRAFT in (verdict.refusal or "")
    assert "none" in (verdict.refusal or "")


def test_another_draft_refused() -> None:
    assert refused(TINY, change(draft="eagle3:other-draft")) == ["draft"]
    assert refused(TINY, change(draft="mtp:target")) == ["draft"]


def test_speculative_token_count_honoured() -> None:
    decode = change(num_speculative_tokens=4)
    assert refused(TINY, decode) == []
    assert honoured(TINY, decode) == ["speculative tokens"]


def test_tp_with_mla_honoured_and_says_how() -> None:
    # The draft's GQA layer keeps its bytes: 2 KV heads on each rank
    # (replicated beyond its head count), as MLA keeps the whole latent.
    decode = change(tp_size=2, tp_rank=1)
    verdict = compare(TINY, decode)
    assert verdict.refusal is None
    (tp,) = verdict.honoured
    assert tp.what == "TP size" and "MLA latent cache is whole" in str(tp)


def test_tp_with_mla_and_a_split_draft_refused() -> None:
    """Upstream splits no heads in a model with MLA (use_mla): a GQA draft
    whose heads are split across decode's ranks cannot be written whole."""
    half = dataclasses.replace(DRAFT, bytes_per_block=8192, heads=1)
    decode = change(tp_size=2, regions=(*TARGET, half))
    assert refused(TINY, decode) == [f"bytes per block of {DRAFT.layer} (GQA K/V)"]
    assert geometry.FLAG_TP in (compare(TINY, decode).refusal or "")


def test_tp_head_split_honoured_in_a_gqa_model() -> None:
    gqa = tuple(
        Region(f"model.layers.{i}.self_attn.attn", GQA_LAYOUT, 32768, 8, "bfloat16")
        for i in range(4)
    )
    p = change(kv_dtype="bfloat16", draft=None, num_speculative_tokens=0, regions=gqa)
    d = change(
        p,
        tp_size=2,
        regions=tuple(
            dataclasses.replace(r, bytes_per_block=16384, heads=4) for r in gqa
        ),
    )
    verdict = compare(p, d)
    assert verdict.refusal is None
    assert "splits or gathers the KV heads" in str(verdict.honoured[0])
    # Other bytes per head (another head size): refused.
    odd = change(d, regions=tuple(dataclasses.replace(r, heads=2) for r in d.regions))
    assert len(compare(p, odd).refused) == 4


def test_tp_sizes_that_do_not_divide_refused() -> None:
    decode = change(tp_size=3)
    verdict = compare(change(tp_size=2), decode)
    assert [x.what for x in verdict.refused] == ["TP size"]
    assert geometry.FLAG_TP in (verdict.refusal or "")


def test_pp_honoured_with_partial_layers() -> None:
    stage = change(pp_size=2, regions=TARGET[:4])
    verdict = compare(TINY, stage)
    assert verdict.refusal is None
    assert honoured(TINY, stage) == ["PP size"]


def test_layer_sets_refused_at_equal_pp() -> None:
    decode = change(regions=(*TARGET[:4], DRAFT))
    verdict = compare(TINY, decode)
    assert refused(TINY, decode) == ["KV layers"]
    assert geometry.FLAG_MODEL in (verdict.refusal or "")


def test_region_layout_and_bytes_refused() -> None:
    flipped = (dataclasses.replace(TARGET[0], layout=GQA_LAYOUT), *TARGET[1:], DRAFT)
    assert refused(TINY, change(regions=flipped)) == [f"layout of {TARGET[0].layer}"]
    wider = (dataclasses.replace(TARGET[0], bytes_per_block=40960), *TARGET[1:], DRAFT)
    assert refused(TINY, change(regions=wider)) == [
        f"bytes per block of {TARGET[0].layer} (MLA-latent)"
    ]


def test_every_field_is_compared() -> None:
    """Each field of Geometry and Region, changed alone, is a difference
    (tp_rank aside: ranks differ by design)."""
    for name in (f.name for f in dataclasses.fields(Geometry)):
        if name in ("tp_rank", "regions"):
            continue
        value = getattr(TINY, name)
        other = {
            int: lambda v: v * 2,
            str: lambda v: v + "x",
        }.get(type(value), lambda v: "eagle3:x")(value)
        assert compare(TINY, change(**{name: other})).differences, name
    for name in (f.name for f in dataclasses.fields(Region)):
        value = getattr(DRAFT, name)
        other = value * 2 if isinstance(value, int) else value + "x"
        regions = (*TARGET, dataclasses.replace(DRAFT, **{name: other}))
        assert compare(TINY, change(regions=regions)).refused, name


def test_wire_round_trip_and_unreadable() -> None:
    encoded = msgspec.msgpack.encode(TINY.wire())
    assert Geometry.from_wire(msgspec.msgpack.decode(encoded)) == TINY
    assert Geometry.from_wire(None) is None
    assert Geometry.from_wire({}) is None
    assert Geometry.from_wire({"block_size": "x"}) is None


def test_dtype_and_draft_names() -> None:
    assert geometry.kv_dtype_name("auto", torch.bfloat16) == "bfloat16"
    assert geometry.kv_dtype_name("fp8", torch.bfloat16) == "fp8_e4m3"
    assert geometry.kv_dtype_name("", "torch.float32") == "float32"
    spec = SimpleNamespace(
        method="eagle3",
        model="/srv/models/a/draft/",
        draft_model_config=None,
        num_speculative_tokens=2,
    )
    assert geometry.draft_name(spec) == ("eagle3:draft", 2)
    assert geometry.draft_name(None) == (None, 0)


def test_describe_is_one_line_grouping_regions() -> None:
    line = TINY.describe()
    assert "\n" not in line
    assert "8 x MLA-latent 36864 B/block" in line
    assert "draft=eagle3:draft k=2" in line


# -- prefill's refusal on a real registered worker --------------------------------
class Socket:
    """What a refused pull's answer is sent through (upstream's ROUTER)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, bytes]] = []

    async def send_multipart(self, parts: tuple[bytes, bytes]) -> None:
        self.sent.append(parts)


def registered(engine: RecordingEngine, *, consumer: bool) -> Any:
    # Registered as a consumer (a producer's registration starts its ZMQ
    # listener), then a producer for what the tests call.
    worker = make_worker(PDMooncakeConnectorWorker, engine, backport=False)
    worker.tp_size, worker.tp_rank, worker.pp_size = 1, 0, 1
    worker._encoder = msgspec.msgpack.Encoder()
    worker._install_geometry()
    worker.register_kv_caches(mixed_caches())
    worker.is_kv_producer = not consumer
    return worker


def decode_pull(decode: Any, transfer_id: str = "xfer-1") -> Any:
    """Decode's pull as prefill decodes it off the wire (decode's encoder
    adds its geometry to upstream's message)."""
    meta = upstream.MooncakeXferMetadata(
        remote_hostname="127.0.0.1",
        remote_port=4242,
        remote_tp_size=1,
        remote_tp_rank=0,
        req_blocks={"d-1": (transfer_id, [[0], [0]])},
        kv_caches_base_addr=decode.kv_caches_base_addr,
        block_lens=decode.block_len_per_layer,
        kv_block_lens=decode.kv_block_len_per_layer,
    )
    return msgspec.msgpack.Decoder(wire.XferMetadata).decode(
        decode._encoder.encode(meta)
    )


def test_worker_states_its_geometry_from_registration(engine: RecordingEngine) -> None:
    worker = registered(engine, consumer=True)
    g = worker.geometry
    assert (g.block_size, g.kernel_block_size, g.kv_dtype) == (16, 16, "float32")
    assert [(r.layer, r.layout) for r in g.regions] == [
        (MLA_LAYER, MLA_LAYOUT),
        (DRAFT_LAYER, GQA_LAYOUT),
    ]
    assert [r.bytes_per_block for r in g.regions] == [16 * 96 * 4, 2 * 16 * 4 * 64 * 4]


def test_prefill_refuses_once_answers_error_and_frees_the_send(
    engine: RecordingEngine,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefill = registered(engine, consumer=False)
    decode = registered(RecordingEngine(), consumer=True)
    decode.geometry = change(decode.geometry, block_size=32)
    # Prefill computed the request: its send waits for decode's pull.
    ready = asyncio.Event()
    ready.set()
    send = upstream.SendBlockMeta("p-1", "xfer-1", [[3], [3]], ready)
    prefill.reqs_need_send = {"xfer-1": send}
    prefill.finished_sending_reqs = set()
    meta = decode_pull(decode)
    with caplog.at_level(logging.INFO, logger="vllm.pd_mooncake"):
        reason = prefill._geometry_refusal(meta)
        assert reason is not None and geometry.FLAG_BLOCK_SIZE in reason
        sock = Socket()
        asyncio.run(prefill._refuse_pull(b"id", sock, reason, meta))
        # A second pull from the same decode worker: refused, not logged again.
        assert prefill._geometry_refusal(decode_pull(decode, "xfer-2")) == reason
    answer = msgspec.msgpack.Decoder(wire.XferResponse).decode(sock.sent[0][1])
    assert answer.status == upstream.MooncakeXferResponseStatus.ERROR
    assert answer.err_msg == reason
    assert prefill.reqs_need_send == {}
    assert prefill.finished_sending_reqs == {"p-1"}
    lines = [r.getMessage() for r in caplog.records if "refusing pulls" in r.message]
    assert len(lines) == 1 and "127.0.0.1:4242" in lines[0]
    # The negative control's switch: the same pull is served unchecked.
    fault = tmp_path / "fault"
    fault.write_text(faults.SKIP_GEOMETRY_CHECK)
    monkeypatch.setenv(faults.FAULT_FILE_ENV, str(fault))
    assert prefill._geometry_refusal(decode_pull(decode)) is None


def test_a_pull_before_prefill_is_ready_is_freed_when_it_is(
    engine: RecordingEngine,
) -> None:
    prefill = registered(engine, consumer=False)
    decode = registered(RecordingEngine(), consumer=True)
    decode.geometry = change(decode.geometry, kv_dtype="bfloat16")
    send = upstream.SendBlockMeta("p-1", "xfer-1", [], asyncio.Event())
    prefill.reqs_need_send = {"xfer-1": send}
    prefill.finished_sending_reqs = set()
    meta = decode_pull(decode)
    reason = prefill._geometry_refusal(meta)
    assert reason is not None
    asyncio.run(prefill._refuse_pull(b"id", Socket(), reason, meta))
    assert "xfer-1" in prefill.reqs_need_send  # still being computed
    send.ready.set()
    prefill._release_refused()
    assert prefill.reqs_need_send == {}
    assert prefill.finished_sending_reqs == {"p-1"}


def test_same_geometry_proceeds_and_first_answer_states_prefill(
    engine: RecordingEngine,
) -> None:
    prefill = registered(engine, consumer=False)
    decode = registered(RecordingEngine(), consumer=True)

    async def first_answers() -> list[Any]:
        assert prefill._geometry_refusal(decode_pull(decode)) is None
        answer = upstream.MooncakeXferResponse(
            status=upstream.MooncakeXferResponseStatus.FINISH
        )
        return [
            msgspec.msgpack.Decoder(wire.XferResponse).decode(
                prefill._encoder.encode(answer)
            )
            for _ in range(2)
        ]

    first, second = asyncio.run(first_answers())
    assert Geometry.from_wire(first.pd_geometry) == prefill.geometry
    assert second.pd_geometry is None  # once per pull


def test_a_peer_without_geometry_is_not_checked(
    engine: RecordingEngine, caplog: pytest.LogCaptureFixture
) -> None:
    prefill = registered(engine, consumer=False)
    meta = upstream.MooncakeXferMetadata(
        remote_hostname="127.0.0.1",
        remote_port=4343,
        remote_tp_size=1,
        remote_tp_rank=0,
        req_blocks={},
        kv_caches_base_addr=[],
        block_lens=[],
        kv_block_lens=[],
    )
    with caplog.at_level(logging.WARNING, logger="vllm.pd_mooncake"):
        assert prefill._geometry_refusal(meta) is None
    assert "states no KV geometry" in caplog.text


# -- what upstream does with a dtype difference, unchecked ---------------------------
def dtype_worker(dtype: torch.dtype) -> Any:
    """A registered connector worker whose KV (specs and tensors) is ``dtype``."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    worker = make_worker(PDMooncakeConnectorWorker, RecordingEngine(), backport=False)
    worker.tp_size, worker.tp_rank, worker.pp_size = 1, 0, 1
    worker.transfer_topo = SimpleNamespace(
        local_replicates_kv_cache=True, total_num_kv_heads=1
    )
    groups = [
        KVCacheGroupSpec(
            g.layer_names,
            dataclasses.replace(g.kv_cache_spec, dtype=dtype),
            is_eagle_group=g.is_eagle_group,
        )
        for g in worker.kv_cache_config.kv_cache_groups
    ]
    worker.kv_cache_config = KVCacheConfig(
        num_blocks=worker.kv_cache_config.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
    )
    worker._layer_specs = {n: g.kv_cache_spec for g in groups for n in g.layer_names}
    caches = {name: cache.to(dtype) for name, cache in mixed_caches().items()}
    worker.register_kv_caches(caches)
    return worker


def unchecked_send(
    prefill: Any,
    decode: Any,
    prefill_blocks: list[int] | None = None,
    decode_blocks: list[int] | None = None,
) -> tuple:
    """Upstream's descriptors for request d-1 (no geometry check): prefill's
    ``prefill_blocks`` (default [0]) into decode's ``decode_blocks`` ([1])."""
    theirs = decode_blocks or [1]
    meta = upstream.MooncakeXferMetadata(
        remote_hostname="127.0.0.1",
        remote_port=4444,
        remote_tp_size=1,
        remote_tp_rank=0,
        req_blocks={"d-1": ("xfer-1", [theirs, theirs])},
        kv_caches_base_addr=decode.kv_caches_base_addr,
        block_lens=decode.block_len_per_layer,
        kv_block_lens=decode.kv_block_len_per_layer,
        registered_layer_names=decode.registered_layer_names,
        registered_layer_indices=decode.registered_layer_indices,
        registered_group_indices=decode.registered_group_indices,
        registered_shared_group_ids=[list(g) for g in decode.region_shared_groups],
        registered_row_offsets=decode.region_row_offsets,
    )
    return build_send(prefill, meta, prefill_blocks or [0], request="d-1")


def test_unchecked_bfloat16_into_float32_writes_half_blocks_silently() -> None:
    """Why the dtype is checked: upstream compares no region lengths for an
    MLA model, and sends a bfloat16 prefill's blocks into a float32 decode's
    as half blocks, without an error (the rest of each block stays stale,
    the written half is read as float32: wrong KV, wrong tokens unless the
    KV checksum catches it)."""
    prefill, decode = dtype_worker(torch.bfloat16), dtype_worker(torch.float32)
    _, _, lengths, err_reqs, err_msg = unchecked_send(prefill, decode)
    assert (err_reqs, err_msg) == ([], None)
    assert lengths == [b // 2 for b in decode.kv_block_len_per_layer]
    assert refused(prefill.geometry, decode.geometry) == ["KV dtype"]


def test_unchecked_float32_into_bfloat16_fails_naming_no_flag() -> None:
    """The other way round upstream's assertion stops the send (the plugin
    turns the raise into a failed send): the request fails with a message
    that names neither the dtype nor a flag."""
    prefill, decode = dtype_worker(torch.float32), dtype_worker(torch.bfloat16)
    _, _, _, err_reqs, err_msg = unchecked_send(prefill, decode)
    assert err_reqs == ["d-1"]
    assert "exceeds remote KV block size" in (err_msg or "")
    assert "dtype" not in (err_msg or "")


def ratio_worker(ratio: int) -> Any:
    """A registered worker of 8 16-token kernel blocks in logical blocks of
    ``ratio`` kernel blocks (--block-size 16 * ratio over the same kernel)."""
    worker = make_worker(
        PDMooncakeConnectorWorker,
        RecordingEngine(),
        backport=False,
        ratio=ratio,
        num_blocks=8 // ratio,
    )
    worker.tp_size, worker.tp_rank, worker.pp_size = 1, 0, 1
    worker.transfer_topo = SimpleNamespace(
        local_replicates_kv_cache=True, total_num_kv_heads=1
    )
    worker.register_kv_caches(
        {MLA_LAYER: torch.zeros(8, 16, 96), DRAFT_LAYER: torch.zeros(8, 16, 8, 64)}
    )
    return worker


def test_unchecked_block_sizes_send_half_the_prompt_to_the_wrong_blocks() -> None:
    """Why tokens per block are checked even where every region's bytes
    agree: 64 prompt tokens are prefill's 16-token blocks 0-3 and decode's
    32-token blocks 2 and 3 (kernel blocks 4-7). Upstream takes prefill's
    last two blocks (its partial prefix hit path) and converts decode's ids
    with prefill's ratio: tokens 32-63 land in decode's kernel blocks 2 and
    3, tokens 0-31 nowhere; no error."""
    prefill, decode = ratio_worker(1), ratio_worker(2)
    assert refused(prefill.geometry, decode.geometry) == ["block size"]
    src, dst, lengths, err_reqs, err_msg = unchecked_send(
        prefill, decode, prefill_blocks=[0, 1, 2, 3], decode_blocks=[2, 3]
    )
    assert (err_reqs, err_msg) == ([], None)
    block = decode.block_len_per_layer[0]
    base = decode.kv_caches_base_addr[0]
    # Where the MLA region's bytes land, in decode's kernel blocks.
    landed = sorted(
        (d - base) // block + i
        for d, n in zip(dst, lengths, strict=True)
        if base <= d < base + 8 * block
        for i in range(n // block)
    )
    assert landed == [2, 3]  # decode reads this prompt from 4, 5, 6 and 7
    assert sum(lengths) == 2 * sum(decode.kv_block_len_per_layer)
    assert src and len(src) == len(dst)
