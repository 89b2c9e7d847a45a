"""pdstack.kv_layout: bytes per block from the models' shapes and the stack's
block size and KV type (the twin's measured values; GPU predictions are fed
in by tests/test_preflight.py)."""

from __future__ import annotations

import pytest

from pdstack import kv_layout, tiny_model
from tests.shared import GQA_DRAFT, MLA_TARGET


def test_the_twin_measured_values() -> None:
    """Measured on the twin: 311296 bytes a 16-token block (README), 36864 per
    MLA layer and 16384 for the draft (the plugin's region report)."""
    layout = kv_layout.layout(MLA_TARGET, GQA_DRAFT, "float32", 16)
    assert layout.bytes_per_block() == 311296
    assert layout.bytes_per_block(kv_layout.MLA) == 8 * 36864
    assert layout.bytes_per_block(kv_layout.GQA) == 16384
    # Whole blocks: 5 tokens move one block, 33 move three (README figures).
    assert layout.transfer_bytes(5) == 311296
    assert layout.transfer_bytes(33) == 933888


def test_the_generated_tiny_pair_has_those_shapes() -> None:
    models = tiny_model.ensure_models(progress=lambda _: None)
    target, draft = map(kv_layout.read_config, (models.target, models.draft))
    layout = kv_layout.layout(target, draft, tiny_model.DTYPE, 16)
    assert layout == kv_layout.layout(MLA_TARGET, GQA_DRAFT, "float32", 16)


def test_block_size_and_dtype_change_the_bytes() -> None:
    bf16_64 = kv_layout.layout(MLA_TARGET, GQA_DRAFT, "bfloat16", 64)
    assert bf16_64.bytes_per_block() == 311296 * 4 // 2
    assert bf16_64.transfer_bytes(65) == 2 * bf16_64.bytes_per_block()
    assert bf16_64.transfer_bytes(64) == bf16_64.bytes_per_block()


def test_tensor_parallel_copies_the_latent_and_splits_kv_heads() -> None:
    one = kv_layout.layout(MLA_TARGET, GQA_DRAFT, "bfloat16", 16)
    two = kv_layout.layout(MLA_TARGET, GQA_DRAFT, "bfloat16", 16, 2)
    assert two.bytes_per_block(kv_layout.MLA) == 2 * one.bytes_per_block(kv_layout.MLA)
    # Two KV heads over two ranks: the same bytes in all.
    assert two.bytes_per_block(kv_layout.GQA) == one.bytes_per_block(kv_layout.GQA)
    # Over four ranks each keeps a replica of one head.
    four = kv_layout.layout(MLA_TARGET, GQA_DRAFT, "bfloat16", 16, 4)
    assert four.bytes_per_block(kv_layout.GQA) == 2 * one.bytes_per_block(kv_layout.GQA)


def test_nested_text_config_is_read() -> None:
    wrapped = {"architectures": ["X"], "text_config": MLA_TARGET}
    want = kv_layout.layout(MLA_TARGET, None, "bfloat16", 64)
    assert kv_layout.layout(wrapped, None, "bfloat16", 64) == want


def test_served_reads_the_servers_labels() -> None:
    layout = kv_layout.served(
        {"block_size": "16", "cache_dtype": "auto"},
        {"kv_cache_dtype": "float32", "tensor_parallel_size": "1"},
        MLA_TARGET,
        GQA_DRAFT,
    )
    assert layout.bytes_per_block() == 311296
    with pytest.raises(kv_layout.LayoutError, match="mooncake_kv_cache_info"):
        kv_layout.served({"block_size": "16"}, {}, MLA_TARGET, GQA_DRAFT)


def test_unknown_dtype_and_bad_block_size_are_errors() -> None:
    with pytest.raises(kv_layout.LayoutError, match="no known size"):
        kv_layout.layout(MLA_TARGET, None, "int3", 16)
    with pytest.raises(kv_layout.LayoutError, match="positive"):
        kv_layout.layout(MLA_TARGET, None, "float32", 0)
