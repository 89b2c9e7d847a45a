"""The connector worker's registration side: the PR 39596 backport, the
start-up report of every registered KV region, and the test-only fault that
corrupts received KV. Mixed into ``PDMooncakeConnectorWorker`` (connector.py),
before upstream's worker class; moved out of connector.py to keep it small.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from pd_mooncake import faults, registration
from pd_mooncake.metrics import RegionMap, RegionPages

logger = logging.getLogger("vllm.pd_mooncake")

# How long the producer waits for its ZMQ listener before failing start-up.
LISTENER_READY_TIMEOUT_S = 120.0


class RegionsWorker:
    def _mla_layers(self, kv_caches: dict[str, torch.Tensor]) -> set[str]:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        specs = getattr(self, "_layer_specs", None)
        if specs is None:
            # A worker from before PR 39596 (0.19.x) has no per-layer specs;
            # this only labels the regions (report, metrics): an MLA latent
            # cache is (blocks, block, latent) in every backend, a K/V one
            # has more dimensions. Addressing never reads shapes.
            return {n for n, c in kv_caches.items() if self.use_mla and c.dim() == 3}
        return {n for n in kv_caches if isinstance(specs.get(n), MLAAttentionSpec)}

    def _register_backport(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """PR 39596 registration for vLLM releases without it (see registration)."""
        if not hasattr(self, "_physical_blocks_per_logical_kv_block"):
            self._register_legacy(kv_caches)
            return
        # Upstream addresses kernel blocks: register per kernel block.
        num_blocks = (
            self.kv_cache_config.num_blocks * self._physical_blocks_per_logical_kv_block
        )
        plan = registration.plan_registration(
            kv_caches, self._mla_layers(kv_caches), num_blocks
        )
        self._apply_plan(plan, kv_caches, num_blocks)
        if self.engine.batch_register_memory(plan.ptrs, plan.lens) != 0:
            raise RuntimeError("Mooncake batch memory registration failed.")
        if not self.is_kv_consumer:
            self._start_sender_listener()

    def _register_legacy(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The backport on a worker from before PR 39596 (vLLM 0.19.x): what
        its register_kv_caches stores (fixes.LEGACY_BACKPORT_SETS), without
        its ``cache.shape[-2 if use_mla else -3] == block_size`` assertion,
        which fails for a GQA draft beside an MLA target (and for any CPU
        K/V cache: shape[-3] is its head count there). Such a worker
        addresses the configured block size, one block per tensor row, so
        every tensor must hold the same number of blocks."""
        if getattr(self.kv_topo, "split_k_and_v", False):
            raise registration.KVLayoutError(
                "the registration backport needs one tensor per layer; this "
                "attention backend keeps K and V apart"
            )
        rows = {cache.shape[0] for cache in kv_caches.values()}
        if len(rows) != 1:
            raise registration.KVLayoutError(
                f"KV cache tensors hold different numbers of blocks: {sorted(rows)}"
            )
        (num_blocks,) = rows
        plan = registration.plan_registration(
            kv_caches, self._mla_layers(kv_caches), num_blocks
        )
        # One entry per registered tensor, as upstream 0.19 keeps them.
        block_len: dict[int, int] = {}
        for region in plan.regions:
            block_len.setdefault(region.base_addr, region.block_len)
        self.num_blocks = num_blocks
        self.kv_caches_base_addr = list(plan.ptrs)
        self.seen_base_addresses = list(plan.ptrs)
        self.block_len_per_layer = [block_len[ptr] for ptr in plan.ptrs]
        self.device_kv_caches = kv_caches
        self._legacy_regions = plan.regions
        if self.engine.batch_register_memory(plan.ptrs, plan.lens) != 0:
            raise RuntimeError("Mooncake batch memory registration failed.")
        if not self.is_kv_consumer:
            self._start_sender_listener()

    def _apply_plan(
        self,
        plan: registration.RegistrationPlan,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
    ) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        regions = plan.regions
        self.num_blocks = num_blocks
        self.kv_caches_base_addr = [r.base_addr for r in regions]
        self.seen_base_addresses = list(plan.ptrs)
        self.block_len_per_layer = [r.block_len for r in regions]
        self.device_kv_caches = kv_caches
        # What upstream reads when it aligns regions with a peer (the list
        # of what is set here is fixes.BACKPORT_SETS).
        group_of = self.kv_cache_config.transfer_group_index_by_layer
        self.kv_block_len_per_layer = [r.kv_block_len for r in regions]
        self.registered_layer_names = [r.layer_name for r in regions]
        self.registered_layer_indices = [
            extract_layer_index(r.layer_name) for r in regions
        ]
        self.registered_group_indices = [group_of[r.layer_name] for r in regions]
        self.region_shared_groups = [(g,) for g in self.registered_group_indices]
        # Upstream treats a block-major MLA tensor as a packed row at
        # offset 0 (eligible for coalescing) and a GQA one as no row (-1).
        self.region_row_offsets = [
            0 if r.layout == registration.MLA_LAYOUT else -1 for r in regions
        ]
        self.opaque_packed_storages = set()
        self._prepared_transfer_regions.clear()

    def _start_sender_listener(self) -> None:
        ready = threading.Event()
        future = upstream.asyncio.run_coroutine_threadsafe(
            self._mooncake_sender_listener(ready), self.sender_loop
        )
        deadline = time.monotonic() + LISTENER_READY_TIMEOUT_S
        while not ready.wait(timeout=1.0):
            if future.done():
                future.result()
                raise RuntimeError("Mooncake sender listener exited before ready.")
            if time.monotonic() > deadline:
                future.cancel()
                raise RuntimeError(
                    f"Mooncake sender listener not ready in {LISTENER_READY_TIMEOUT_S}s"
                )

    def _describe_regions(
        self, kv_caches: dict[str, torch.Tensor]
    ) -> list[registration.Region]:
        legacy = getattr(self, "_legacy_regions", None)
        if legacy is not None:  # registered by _register_legacy
            return list(legacy)
        mla = self._mla_layers(kv_caches)
        kv_lens = self.kv_block_len_per_layer
        names = self.registered_layer_names
        return [
            registration.Region(
                name,
                registration.MLA_LAYOUT if name in mla else registration.GQA_LAYOUT,
                base,
                block_len,
                kv_len,
            )
            for name, base, block_len, kv_len in zip(
                names,
                self.kv_caches_base_addr,
                self.block_len_per_layer,
                kv_lens,
                strict=True,
            )
        ]

    def _region_map(self) -> RegionMap:
        num_blocks = (
            self.kv_cache_config.num_blocks * self._physical_blocks_per_logical_kv_block
            if hasattr(self, "_physical_blocks_per_logical_kv_block")
            else self.num_blocks  # before PR 39596: blocks are tensor rows
        )
        return RegionMap(
            [
                RegionPages(
                    r.layer_name,
                    r.layout,
                    r.base_addr,
                    r.block_len,
                    r.kv_block_len,
                    num_blocks,
                )
                for r in self.regions
            ]
        )

    def _log_region_report(self) -> None:
        kernel = self.block_size  # upstream set it to the kernel block size
        path = "backport (PR 39596)" if self.backport else "upstream"
        logger.info(
            "PD Mooncake: %d KV regions registered, kernel block size %d, "
            "registration %s",
            len(self.regions),
            kernel,
            path,
        )
        for region in self.regions:
            logger.info(
                "PD Mooncake region: layer=%s layout=%s bytes_per_block=%d "
                "kernel_block_size=%d",
                region.layer_name,
                region.layout,
                region.kv_block_len,
                kernel,
            )

    def _corrupt(
        self, response: Any, pull_metas: dict, draft_only: bool = False
    ) -> None:
        ratio = self._physical_blocks_per_logical_kv_block
        caches = self.device_kv_caches
        if draft_only:
            caches = faults.draft_caches(
                caches, self.vllm_config.model_config.hf_config.num_hidden_layers
            )
        for req_id in response.ok_reqs or []:
            meta = pull_metas.get(req_id)
            if meta is None:
                continue
            logical = [b for group in meta.local_block_ids for b in group]
            hit = faults.corrupt_blocks(
                caches,
                registration.kernel_block_ids(logical, ratio),
                num_blocks=self.kv_cache_config.num_blocks * ratio,
            )
            logger.warning(
                "TEST FAULT: corrupted %d received blocks of %s", hit, req_id
            )
