"""Mixed MLA + Eagle KV registration (vLLM PR 39596 and its backport)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnectorWorker,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

from conftest import (
    BLOCK_SIZE,
    DRAFT_LAYER,
    MLA_LAYER,
    NUM_BLOCKS,
    REGISTRATION_STATE,
    assert_registered_by_byte_length,
    make_worker,
    mixed_caches,
)
from pd_mooncake import registration
from pd_mooncake.connector import PDMooncakeConnectorWorker


def test_mixed_shapes_register_by_byte_length(engine) -> None:
    caches = mixed_caches()
    mla, draft = caches[MLA_LAYER], caches[DRAFT_LAYER]
    worker = make_worker(PDMooncakeConnectorWorker, engine, backport=True)
    worker.register_kv_caches(caches)

    assert_registered_by_byte_length(worker, engine, mla, draft)
    print(f"registered {engine.registered}, block_lens {worker.block_len_per_layer}")


def registrations(consumer: bool) -> dict[str, tuple[list, dict]]:
    """What upstream's and the backport's register_kv_caches register and
    derive, for the same caches (Mooncake memory and REGISTRATION_STATE)."""
    from conftest import RecordingEngine

    caches = mixed_caches()
    results = {}
    for name, cls, backport in (
        ("upstream", MooncakeConnectorWorker, False),
        ("backport", PDMooncakeConnectorWorker, True),
    ):
        engine = RecordingEngine()
        worker = make_worker(cls, engine, backport=backport, consumer=consumer)
        listening = listener_stub(worker) if not consumer else None
        try:
            worker.register_kv_caches(caches)
        finally:
            if listening:
                listening()
        if not consumer:
            # A producer starts its sender listener once registration is done.
            assert worker.listener_started == 1
            # shutdown() (run by __del__) would stop a producer's executor,
            # listener thread and bootstrap server: none was started here.
            worker.is_kv_consumer = True
        state = {key: getattr(worker, key) for key in REGISTRATION_STATE}
        results[name] = (engine.registered, state)
        engine.batch_unregister_memory(engine.registered[0][0])
    return results


def listener_stub(worker: Any) -> Callable[[], None]:
    """A producer's registration ends by starting the ZMQ sender listener
    (bootstrap server, side channel): replaced by one that reports ready at
    once, on a real event loop thread. Returns the loop's stop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    worker.sender_loop = loop
    worker.listener_started = 0

    async def listener(ready: threading.Event) -> None:
        worker.listener_started += 1
        ready.set()

    worker._mooncake_sender_listener = listener

    def stop() -> None:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    return stop


def pre_fix_plan(real_plan: Callable) -> Callable:
    """Registration as before PR 39596: the kernel block size read from each
    tensor's shape[-2] (the MLA position, also for the GQA draft, where it is
    the head count), so the draft is cut into 16 // 8 = 2x too many blocks."""

    def plan(caches, mla_layers, num_blocks):
        parts = [
            real_plan(
                {name: cache}, mla_layers, num_blocks * BLOCK_SIZE // cache.shape[-2]
            )
            for name, cache in caches.items()
        ]
        return registration.RegistrationPlan(
            [ptr for part in parts for ptr in part.ptrs],
            [n for part in parts for n in part.lens],
            [region for part in parts for region in part.regions],
        )

    return plan


def test_negative_control_pre_fix_registration_differs_from_upstream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Negative control: the backport path with the shape-derived block size
    PR 39596 removed registers the draft with half its block length, and the
    comparison with upstream (below) says so."""
    monkeypatch.setattr(
        registration, "plan_registration", pre_fix_plan(registration.plan_registration)
    )
    results = registrations(consumer=True)
    draft = mixed_caches()[DRAFT_LAYER]
    upstream_lens = results["upstream"][1]["block_len_per_layer"]
    backport_lens = results["backport"][1]["block_len_per_layer"]
    assert upstream_lens[1] == draft.nbytes // NUM_BLOCKS
    assert backport_lens[1] == draft.nbytes // (2 * NUM_BLOCKS)
    assert backport_lens[0] == upstream_lens[0]  # the MLA layer is unaffected
    assert results["backport"] != results["upstream"]


@pytest.mark.parametrize("consumer", [True, False], ids=["consumer", "producer"])
def test_backport_registers_what_upstream_registers(consumer: bool) -> None:
    results = registrations(consumer)
    assert registration.upstream_has_fix(MooncakeConnectorWorker)
    assert results["backport"] == results["upstream"]


def test_upstream_path_is_default_where_upstream_has_the_fix(engine) -> None:
    worker = make_worker(PDMooncakeConnectorWorker, engine, backport=False)
    worker.register_kv_caches(mixed_caches())
    assert [r.layout for r in worker.regions] == [
        registration.MLA_LAYOUT,
        registration.GQA_LAYOUT,
    ]


def test_region_report_names_every_region(engine, caplog) -> None:
    worker = make_worker(PDMooncakeConnectorWorker, engine, backport=True)
    with caplog.at_level(logging.INFO, logger="vllm.pd_mooncake"):
        worker.register_kv_caches(mixed_caches())
    lines = [r.getMessage() for r in caplog.records if "region: layer=" in r.message]
    assert lines == [
        f"PD Mooncake region: layer={MLA_LAYER} layout=MLA-latent "
        "bytes_per_block=6144 kernel_block_size=16",
        f"PD Mooncake region: layer={DRAFT_LAYER} layout=GQA K/V "
        "bytes_per_block=32768 kernel_block_size=16",
    ]


def test_kernel_block_size_comes_from_the_backends() -> None:
    backends = [CPUMLABackend, CPUAttentionBackend]
    assert registration.kernel_block_size(16, backends, None) == (16, 1)
    # A 32-token logical block is two 16-token kernel blocks (CPU MLA's size).
    assert registration.kernel_block_size(32, backends, None) == (16, 2)


def test_logical_to_kernel_block_ids() -> None:
    assert registration.kernel_block_ids([0, 3], 1) == [0, 3]
    assert registration.kernel_block_ids([1, 3], 2) == [2, 3, 6, 7]


def test_non_contiguous_tensor_is_rejected_with_its_layer_name() -> None:
    caches = mixed_caches()
    caches[DRAFT_LAYER] = caches[DRAFT_LAYER].transpose(1, 2)
    with pytest.raises(registration.KVLayoutError, match=DRAFT_LAYER):
        registration.plan_registration(caches, {MLA_LAYER}, NUM_BLOCKS)


def test_tensor_not_whole_blocks_is_rejected() -> None:
    caches = {MLA_LAYER: torch.zeros(3, 16, 96)}
    with pytest.raises(registration.KVLayoutError, match="whole number"):
        registration.plan_registration(caches, {MLA_LAYER}, 5)
