"""Mixed MLA + Eagle KV registration (vLLM PR 39596 and its backport)."""

from __future__ import annotations

import logging

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnectorWorker,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

from conftest import (
    DRAFT_LAYER,
    MLA_LAYER,
    NUM_BLOCKS,
    REGISTRATION_STATE,
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

    assert engine.registered == [
        ([mla.data_ptr(), draft.data_ptr()], [mla.nbytes, draft.nbytes])
    ]
    assert worker.kv_caches_base_addr == [mla.data_ptr(), draft.data_ptr()]
    assert worker.block_len_per_layer == [
        mla.nbytes // mla.shape[0],
        draft.nbytes // draft.shape[0],
    ]
    print(f"registered {engine.registered}, block_lens {worker.block_len_per_layer}")


def test_pre_fix_shape_check_rejects_the_draft() -> None:
    """Negative control: the check PR 39596 removed fails on these tensors."""
    caches = mixed_caches()
    use_mla, block_size = True, 16
    kernel = {n: c.shape[-2 if use_mla else -3] for n, c in caches.items()}
    assert kernel[MLA_LAYER] == block_size
    assert kernel[DRAFT_LAYER] == 8 != block_size  # the draft's KV heads


@pytest.mark.parametrize("consumer", [True])
def test_backport_registers_what_upstream_registers(consumer: bool) -> None:
    from conftest import RecordingEngine

    caches = mixed_caches()
    results = {}
    for name, cls, backport in (
        ("upstream", MooncakeConnectorWorker, False),
        ("backport", PDMooncakeConnectorWorker, True),
    ):
        engine = RecordingEngine()
        worker = make_worker(cls, engine, backport=backport, consumer=consumer)
        worker.register_kv_caches(caches)
        state = {key: getattr(worker, key) for key in REGISTRATION_STATE}
        results[name] = (engine.registered, state)
        engine.batch_unregister_memory(engine.registered[0][0])
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
