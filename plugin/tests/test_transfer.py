"""A real Mooncake transfer of mixed MLA + GQA blocks between two processes.

The receiver process plays decode, this process plays prefill. Blocks are
chosen by the connector's own addressing (byte-length regions, logical to
kernel block ids); the copied blocks must be byte-identical and every other
block of the receiver untouched.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import torch

from conftest import DRAFT_LAYER, MLA_LAYER, RecordingEngine
from pd_mooncake import registration

LOGICAL_BLOCKS = 4
RATIO = 2  # a 32-token logical block = two 16-token kernel blocks
KERNEL_BLOCKS = LOGICAL_BLOCKS * RATIO
SHAPES = {MLA_LAYER: (KERNEL_BLOCKS, 16, 96), DRAFT_LAYER: (KERNEL_BLOCKS, 16, 8, 64)}
DEADLINE_S = 60.0


def receiver(to_sender: Any, from_sender: Any) -> None:
    """Decode side: register zeroed caches, wait, report what arrived."""
    engine = RecordingEngine()
    caches = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    plan = registration.plan_registration(caches, {MLA_LAYER}, KERNEL_BLOCKS)
    engine.batch_register_memory(plan.ptrs, plan.lens)
    to_sender.put(
        (
            engine.engine.get_rpc_port(),
            [(r.base_addr, r.block_len) for r in plan.regions],
        )
    )
    from_sender.get(timeout=DEADLINE_S)  # "done"
    # Plain bytes: tensors would travel as shared memory that dies with us.
    to_sender.put({name: cache.numpy().tobytes() for name, cache in caches.items()})


def transfer(logical_ids: list[int], ratio_used: int) -> tuple[dict, dict, list[int]]:
    ctx = mp.get_context("spawn")
    to_sender, from_sender = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(to_sender, from_sender), daemon=True)
    proc.start()
    try:
        port, remote_regions = to_sender.get(timeout=DEADLINE_S)
        engine = RecordingEngine()
        generator = torch.Generator().manual_seed(1)
        caches = {n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}
        plan = registration.plan_registration(caches, {MLA_LAYER}, KERNEL_BLOCKS)
        engine.batch_register_memory(plan.ptrs, plan.lens)
        kernel_ids = registration.kernel_block_ids(logical_ids, ratio_used)
        src, dst, lens = [], [], []
        for local, (remote_base, remote_len) in zip(
            plan.regions, remote_regions, strict=True
        ):
            assert local.block_len == remote_len
            for block in kernel_ids:
                src.append(local.base_addr + block * local.block_len)
                dst.append(remote_base + block * remote_len)
                lens.append(local.kv_block_len)
        session = f"127.0.0.1:{port}"
        assert engine.engine.batch_transfer_sync_write(session, src, dst, lens) == 0
        from_sender.put("done")
        received = {
            name: torch.frombuffer(bytearray(raw), dtype=torch.float32).view(
                SHAPES[name]
            )
            for name, raw in to_sender.get(timeout=DEADLINE_S).items()
        }
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return caches, received, registration.kernel_block_ids(logical_ids, RATIO)


def mismatches(sent: dict, received: dict, expected_blocks: list[int]) -> list[str]:
    problems = []
    for name in SHAPES:
        for block in range(KERNEL_BLOCKS):
            got = received[name][block]
            if block in expected_blocks:
                if not torch.equal(got, sent[name][block]):
                    problems.append(f"{name} block {block}: not the sent bytes")
            elif torch.count_nonzero(got):
                problems.append(f"{name} block {block}: touched")
    return problems


def test_blocks_arrive_byte_identical_and_nothing_else_is_touched() -> None:
    sent, received, expected = transfer([1, 3], RATIO)
    assert expected == [2, 3, 6, 7]
    assert mismatches(sent, received, expected) == []
    moved = sum(SHAPES_BYTES_PER_BLOCK.values()) * len(expected)
    print(f"moved {moved} bytes in {len(expected) * len(SHAPES)} descriptors")


def test_wrong_block_ratio_is_caught() -> None:
    """Negative control: addressing logical ids as kernel ids misplaces KV."""
    sent, received, expected = transfer([1, 3], 1)
    problems = mismatches(sent, received, expected)
    assert problems, "the check did not notice misaddressed blocks"


SHAPES_BYTES_PER_BLOCK = {
    name: torch.zeros(shape[1:]).nbytes for name, shape in SHAPES.items()
}
