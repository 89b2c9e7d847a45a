"""The seed's case on the seed's broken release: vLLM 0.19.x, before PR 39596.

Its Mooncake worker asserts ``cache.shape[-2 if use_mla else -3] ==
block_size`` in register_kv_caches, which an Eagle draft's GQA cache beside
an MLA target fails (its shape[-2] is the head count). These tests build
0.19's real ``MooncakeConnectorWorker`` and the plugin's worker through their
constructors, with the distributed and network dependencies patched as
upstream's own unit tests patch them (tests/v1/kv_connector/unit/
test_mooncake_connector.py), and a real TransferEngine on loopback TCP. No
vLLM release runs the seed's stack end to end on CPU (no CPU MLA backend
before 0.28, no speculative decoding on the CPU runner before 0.20): this is
the registration and transfer code, in-process.

They run in ``make test-compat``'s 0.19 venv; on a vLLM with PR 39596 (the
main venv) the module is skipped, detected by feature.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import msgspec
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from pd_mooncake import registration

if registration.upstream_has_fix(upstream.MooncakeConnectorWorker):
    pytest.skip(
        "the installed vLLM has PR 39596 (no seed assertion to backport over): "
        "these run in make test-compat's vLLM 0.19 venv",
        allow_module_level=True,
    )

from bench.loopback import Peer, tcp_engine
from conftest import assert_registered_by_byte_length, pull_fields
from pd_mooncake.connector import PDMooncakeConnectorWorker

MLA_LAYER = "model.layers.0.self_attn.attn"
DRAFT_LAYER = "model.layers.8.self_attn.attn"
BLOCK_SIZE = 16
NUM_BLOCKS = 2
TRANSFER_BLOCKS = 4
DEADLINE_S = 60.0
PREFILL_BLOCKS = [1, 3]
DECODE_BLOCKS = [0, 2]


def shapes(num_blocks: int) -> dict[str, tuple[int, ...]]:
    """The seed's MLA latent cache and its Eagle draft's GQA cache."""
    return {
        MLA_LAYER: (num_blocks, BLOCK_SIZE, 96),
        DRAFT_LAYER: (num_blocks, BLOCK_SIZE, 8, 64),
    }


class RecordingEngine:
    """A real TransferEngine that also remembers what was registered."""

    def __init__(self) -> None:
        self.engine = tcp_engine()
        self.registered: list[tuple[list[int], list[int]]] = []

    def initialize(self, *args: Any) -> int:
        return 0  # tcp_engine() initialised it on loopback TCP

    def batch_register_memory(self, ptrs: list[int], lens: list[int]) -> int:
        self.registered.append((list(ptrs), list(lens)))
        return self.engine.batch_register_memory(ptrs, lens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def vllm_config(producer: bool) -> Any:
    """What 0.19's worker constructor reads (no model to load here)."""
    from vllm.config import KVTransferConfig

    return SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="PDMooncakeConnector",
            kv_role="kv_producer" if producer else "kv_consumer",
            engine_id="pd-test",
            kv_connector_extra_config={"mooncake_protocol": "tcp"},
        ),
        parallel_config=SimpleNamespace(
            data_parallel_index=0,
            data_parallel_rank_local=0,
            local_engines_only=False,
            pipeline_parallel_size=1,
        ),
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE),
        model_config=SimpleNamespace(
            use_mla=True,
            get_total_num_kv_heads=lambda: 1,
            max_model_len=TRANSFER_BLOCKS * BLOCK_SIZE,
        ),
    )


@contextlib.contextmanager
def worker_dependencies() -> Iterator[list[RecordingEngine]]:
    """Upstream's unit-test patches: TP/PP groups, the host address, the
    attention backend (vLLM's CPU one), no bootstrap server; the
    TransferEngine is real, recorded. Yields the engines built."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    engines: list[RecordingEngine] = []

    def engine() -> RecordingEngine:
        engines.append(RecordingEngine())
        return engines[-1]

    where = upstream.__name__
    with contextlib.ExitStack() as stack:
        for name, value in {
            "TransferEngine": engine,
            "get_ip": lambda: "127.0.0.1",
            "get_tensor_model_parallel_rank": lambda: 0,
            "get_tensor_model_parallel_world_size": lambda: 1,
            "get_pp_group": lambda: SimpleNamespace(rank_in_group=0),
            "get_current_attn_backend": lambda config: CPUAttentionBackend,
            "get_kv_cache_layout": lambda: "NHD",
            "should_launch_bootstrap_server": lambda config: False,
        }.items():
            stack.enter_context(mock.patch(f"{where}.{name}", value))
        yield engines


def build(cls: type, producer: bool) -> tuple[Any, RecordingEngine]:
    """``cls(vllm_config, engine_id)``, as 0.19's MooncakeConnector builds
    its worker; a producer's ZMQ side channel answers ready at once (its
    bind is not what is tested)."""
    with worker_dependencies() as engines:
        worker = cls(vllm_config(producer), "pd-test")

    async def listener(ready: threading.Event) -> None:
        ready.set()

    worker._mooncake_sender_listener = listener
    return worker, engines[0]


def caches(num_blocks: int, fill: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        name: torch.randn(shape, generator=generator) if fill else torch.zeros(shape)
        for name, shape in shapes(num_blocks).items()
    }


@pytest.mark.parametrize("producer", [False, True], ids=["consumer", "producer"])
def test_negative_control_upstream_dies_on_the_seed_assertion(producer: bool) -> None:
    worker, _ = build(upstream.MooncakeConnectorWorker, producer)
    try:
        with pytest.raises(AssertionError):
            worker.register_kv_caches(caches(NUM_BLOCKS, fill=True))
    finally:
        worker.shutdown()


@pytest.mark.parametrize("producer", [False, True], ids=["consumer", "producer"])
def test_plugin_registers_every_tensor_by_byte_length(producer: bool) -> None:
    kv = caches(NUM_BLOCKS, fill=True)
    mla, draft = kv[MLA_LAYER], kv[DRAFT_LAYER]
    worker, engine = build(PDMooncakeConnectorWorker, producer)
    try:
        assert worker.backport  # upstream lacks PR 39596: on without asking
        worker.register_kv_caches(kv)
        assert_registered_by_byte_length(worker, engine, mla, draft)
        assert worker.num_blocks == NUM_BLOCKS
        assert [r.layout for r in worker.regions] == [
            registration.MLA_LAYOUT,
            registration.GQA_LAYOUT,
        ]
    finally:
        worker.shutdown()
        engine.batch_unregister_memory(engine.registered[0][0])


def test_start_up_report_says_the_backport_attaches() -> None:
    from pd_mooncake import fixes

    report = fixes.installed_report()
    print(report.line())
    assert "registration_backport" in report.attached
    assert "worker_class" in report.attached
    assert fixes._backport_on({}, True, False)


# --- a real transfer between two processes --------------------------------------


class Decode:
    """Decode's side, in a process of its own: zeroed caches registered by
    the plugin's worker on 0.19."""

    def __init__(self) -> None:
        self.caches = caches(TRANSFER_BLOCKS, fill=False)
        self.worker, self.engine = build(PDMooncakeConnectorWorker, producer=False)
        self.worker.register_kv_caches(self.caches)

    def metadata(self) -> bytes:
        """The pull 0.19's receive_kv_from_single_worker sends."""
        return msgspec.msgpack.encode(
            upstream.MooncakeXferMetadata(**pull_fields(self.worker, DECODE_BLOCKS))
        )

    def read(self) -> dict[str, bytes]:
        return {name: cache.numpy().tobytes() for name, cache in self.caches.items()}


def transfer(break_draft_stride: bool = False) -> tuple[dict, dict]:
    """Prefill's PREFILL_BLOCKS into decode's DECODE_BLOCKS, descriptors by
    0.19's own addressing (_get_transfer_regions, _build_transfer_params)."""
    with Peer(Decode, deadline_s=DEADLINE_S) as decode:
        meta = msgspec.msgpack.decode(
            decode.call("metadata"), type=upstream.MooncakeXferMetadata
        )
        sent = caches(TRANSFER_BLOCKS, fill=True)
        worker, engine = build(PDMooncakeConnectorWorker, producer=True)
        try:
            worker.register_kv_caches(sent)
            if break_draft_stride:
                # Negative control: the draft's stride as the seed's shape
                # reading gives it without the assertion (shape[-2] = 8 heads
                # as the block size: half the real block length).
                worker.block_len_per_layer[1] //= 2
            local = worker._get_transfer_regions(
                worker.kv_caches_base_addr, worker.block_len_per_layer
            )
            remote = worker._get_transfer_regions(
                meta.kv_caches_base_addr, meta.block_lens
            )
            send_meta = upstream.SendBlockMeta(
                p_req_id="p-req",
                transfer_id="xfer-1",
                local_block_ids=PREFILL_BLOCKS,
                ready=asyncio.Event(),
            )
            src, dst, lens, err_reqs, err_msg = asyncio.run(
                worker._build_transfer_params(
                    [("d-req", send_meta)], meta, local, remote
                )
            )
            assert (err_reqs, err_msg) == ([], None)
            session = f"{meta.remote_hostname}:{meta.remote_port}"
            assert worker._send_blocks(session, src, dst, lens) == 0
            received = {
                name: torch.frombuffer(bytearray(raw), dtype=torch.float32).view(
                    shapes(TRANSFER_BLOCKS)[name]
                )
                for name, raw in decode.call("read").items()
            }
        finally:
            worker.shutdown()
            engine.batch_unregister_memory(engine.registered[0][0])
    return sent, received


def mismatches(sent: dict, received: dict) -> list[str]:
    """Decode's DECODE_BLOCKS[i] must hold prefill's PREFILL_BLOCKS[i], every
    other block of decode's must still be zero."""
    source = dict(zip(DECODE_BLOCKS, PREFILL_BLOCKS, strict=True))
    problems = []
    for name in sent:
        for block in range(TRANSFER_BLOCKS):
            got = received[name][block]
            if block in source:
                if not torch.equal(got, sent[name][source[block]]):
                    problems.append(f"{name} block {block}: not {source[block]}")
            elif torch.count_nonzero(got):
                problems.append(f"{name} block {block}: touched")
    return problems


def test_blocks_arrive_byte_identical_and_nothing_else_is_touched() -> None:
    sent, received = transfer()
    assert mismatches(sent, received) == []


def test_negative_control_a_wrong_stride_is_caught() -> None:
    sent, received = transfer(break_draft_stride=True)
    problems = mismatches(sent, received)
    assert problems and all(DRAFT_LAYER in p for p in problems), problems
