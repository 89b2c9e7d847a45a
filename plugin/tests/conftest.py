"""Shared fixtures: real Mooncake TransferEngines over TCP on loopback and
mixed MLA + GQA KV tensors shaped like a DeepSeek target with an Eagle draft."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zmq.asyncio

pytest.importorskip("vllm")
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
)

import pd_mooncake
from bench.loopback import tcp_engine
from pd_mooncake.fixes import BACKPORT_SETS

MLA_LAYER = "model.layers.0.self_attn.attn"
DRAFT_LAYER = "model.layers.8.self_attn.attn"
NUM_BLOCKS = 2
# What upstream derives from registration (the backport must match all of
# it): fixes.BACKPORT_SETS but for the caches themselves, their block count and
# the pointer bookkeeping.
REGISTRATION_STATE = tuple(
    sorted(
        BACKPORT_SETS
        - {
            "num_blocks",
            "device_kv_caches",
            "seen_base_addresses",
            "opaque_packed_storages",
        }
    )
)
BLOCK_SIZE = 16


class RecordingEngine:
    """A real TransferEngine that also remembers what was registered."""

    def __init__(self) -> None:
        self.engine = tcp_engine()
        self.registered: list[tuple[list[int], list[int]]] = []

    def batch_register_memory(self, ptrs: list[int], lens: list[int]) -> int:
        self.registered.append((list(ptrs), list(lens)))
        return self.engine.batch_register_memory(ptrs, lens)

    def batch_unregister_memory(self, ptrs: list[int]) -> int:
        return self.engine.batch_unregister_memory(ptrs)


@pytest.fixture(autouse=True, scope="session")
def plugin_registered() -> None:
    pd_mooncake.register()


@pytest.fixture
def engine() -> Iterator[RecordingEngine]:
    recorder = RecordingEngine()
    yield recorder
    for ptrs, _ in recorder.registered:
        recorder.batch_unregister_memory(ptrs)


def mixed_caches() -> dict[str, torch.Tensor]:
    """MLA latent cache (blocks, block, latent) and GQA draft cache (blocks,
    block, heads, dim): the draft's shape[-2] is its head count, not 16."""
    generator = torch.Generator().manual_seed(0)
    return {
        MLA_LAYER: torch.randn(NUM_BLOCKS, BLOCK_SIZE, 96, generator=generator),
        DRAFT_LAYER: torch.randn(NUM_BLOCKS, BLOCK_SIZE, 8, 64, generator=generator),
    }


def kv_cache_config(
    num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE
) -> KVCacheConfig:
    mla = MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=96, dtype=torch.float32
    )
    # K and V halves: 2 * 16 * 4 * 64 floats = one (16, 8, 64) block.
    gqa = FullAttentionSpec(
        block_size=block_size, num_kv_heads=4, head_size=64, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([MLA_LAYER], mla),
            KVCacheGroupSpec([DRAFT_LAYER], gqa, is_eagle_group=True),
        ],
    )


def make_worker(
    cls: type,
    engine: Any,
    *,
    backport: bool,
    ratio: int = 1,
    consumer: bool = True,
    num_blocks: int = NUM_BLOCKS,
) -> Any:
    """A worker with only the state registration reads (MLA topology set):
    ``num_blocks`` logical blocks of ``ratio`` 16-token kernel blocks each.

    The full constructor needs a running vLLM (distributed groups, bootstrap
    server); registration itself only needs these fields.
    """
    config = kv_cache_config(num_blocks, BLOCK_SIZE * ratio)
    worker = object.__new__(cls)
    worker.use_mla = True
    worker.engine = engine
    worker.is_kv_consumer = consumer
    worker.is_kv_producer = not consumer
    # What shutdown() (run by __del__) touches.
    worker.async_zmq_ctx = zmq.asyncio.Context()
    worker.receiver_loop = asyncio.new_event_loop()
    # Registration state as upstream's constructor initialises it.
    for name in REGISTRATION_STATE:
        setattr(worker, name, [])
    worker.block_size = BLOCK_SIZE * ratio
    worker.kv_cache_config = config
    worker._physical_blocks_per_logical_kv_block = ratio
    worker._layer_specs = {
        name: group.kv_cache_spec
        for group in config.kv_cache_groups
        for name in group.layer_names
    }
    worker._prepared_transfer_regions = {}
    worker.backport = backport
    worker.regions = []
    worker.protocol = "tcp"
    worker.vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=NUM_BLOCKS * BLOCK_SIZE)
    )
    from pd_mooncake.metrics import PDMooncakeStats

    worker.xfer_stats = PDMooncakeStats()
    return worker


def pull_worker(interval: float) -> Any:
    """A decode worker with only what a pull's failure path touches (the full
    constructor needs a running vLLM)."""
    import queue

    from pd_mooncake.connector import PDMooncakeConnectorWorker
    from pd_mooncake.metrics import PDMooncakeStats

    worker = object.__new__(PDMooncakeConnectorWorker)
    worker.liveness_interval_s = interval
    # The connector's own (its counters: block holds).
    worker.xfer_stats = PDMooncakeStats()
    worker._is_hma_required = False
    worker._invalid_block_ids = queue.Queue()
    worker._failed_recv_reqs = queue.Queue()
    worker.finished_recving_reqs = set()
    return worker


def pull_meta(bootstrap: str, tasks: int = 0) -> dict[str, upstream.PullReqMeta]:
    """Decode's pull of blocks 4 and 5 for request d-1 from ``bootstrap``."""
    meta = upstream.PullReqMeta(
        d_req_id="d-1",
        transfer_id="xfer-1",
        local_block_ids=[[4, 5]],
        remote_engine_id="pd-prefill",
        remote_bootstrap_addr=bootstrap,
    )
    meta.pull_tasks_count = tasks
    return {"d-1": meta}


async def never_answers(self: Any, worker_addr: str, pull_metas: dict) -> None:
    await asyncio.sleep(3600)  # the side channel went with its prefill


@pytest.fixture
def pull_never_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        upstream.MooncakeConnectorWorker, "receive_kv_from_single_worker", never_answers
    )


def timed_pull(
    worker: Any,
    bootstrap: str,
    limit_s: float,
    busy_loop_s: float = 0.0,
    tasks: int = 0,
) -> tuple[bool, float]:
    """(finished within limit_s, seconds) of the worker's pull from
    ``bootstrap``. ``busy_loop_s``: block decode's receiver loop that long once
    per liveness interval (a loaded decode)."""
    interval = worker.liveness_interval_s

    async def hog() -> None:
        while True:
            await asyncio.sleep(interval / 2)
            time.sleep(busy_loop_s)  # holds the loop, as a CPU-bound step would

    async def go() -> tuple[bool, float]:
        hogging = asyncio.ensure_future(hog()) if busy_loop_s else None
        start = time.monotonic()
        try:
            await asyncio.wait_for(
                worker.receive_kv_from_single_worker(
                    "tcp://127.0.0.1:1", pull_meta(bootstrap, tasks)
                ),
                limit_s,
            )
        except asyncio.TimeoutError:
            return False, time.monotonic() - start
        finally:
            if hogging:
                hogging.cancel()
        return True, time.monotonic() - start

    return asyncio.run(go())


STALL_S = 0.05  # the short-stall tests' Mooncake transfer timeout


@pytest.fixture
def short_stalls(monkeypatch: pytest.MonkeyPatch) -> None:
    from pd_mooncake import connector

    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    monkeypatch.setattr(connector, "MOONCAKE_TRANSFER_TIMEOUT_S", STALL_S)


def pull_fields(worker: Any, blocks: list) -> dict[str, Any]:
    """What decode's registered ``worker`` puts in its pull for request
    ``d-req`` into ``blocks``: the MooncakeXferMetadata fields 0.19.1 and 0.32
    share (0.32 adds pipeline size, KV block lengths and the region fields;
    its ``blocks`` are one list per KV cache group, 0.19.1's one flat list)."""
    return {
        "remote_hostname": worker.hostname,
        "remote_port": worker.rpc_port,
        "remote_tp_size": worker.tp_size,
        "remote_tp_rank": worker.tp_rank,
        "req_blocks": {"d-req": ("xfer-1", blocks)},
        "kv_caches_base_addr": worker.kv_caches_base_addr,
        "block_lens": worker.block_len_per_layer,
    }


def assert_registered_by_byte_length(
    worker: Any, engine: Any, mla: torch.Tensor, draft: torch.Tensor
) -> None:
    """The seed's expectation (PR 39596): each KV tensor registered as
    (data_ptr, nbytes), its block length nbytes // its number of blocks."""
    assert engine.registered == [
        ([mla.data_ptr(), draft.data_ptr()], [mla.nbytes, draft.nbytes])
    ]
    assert worker.kv_caches_base_addr == [mla.data_ptr(), draft.data_ptr()]
    assert worker.block_len_per_layer == [
        mla.nbytes // mla.shape[0],
        draft.nbytes // draft.shape[0],
    ]
