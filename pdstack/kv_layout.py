"""What one P/D transfer should move for the tiny profile, from its KV layout.

Prefill pushes whole 16-token blocks of every registered region: eight MLA
latent layers (kv_lora_rank + qk_rope_head_dim values per token) and the
Eagle3 draft's GQA layer (K and V for each KV head). A transfer of any other
size means a region is missing, duplicated or mis-sized.
"""

from __future__ import annotations

from pdstack import tiny_model as tm

BLOCK_SIZE = 16
MLA = "MLA-latent"
GQA = "GQA K/V"


def tokens_loaded(prompt_tokens: int) -> int:
    """Prompt tokens decode loads from prefill (all of them: no Mamba layers)."""
    return prompt_tokens


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def target_bytes(tokens: int) -> int:
    return blocks(tokens) * BLOCK_SIZE * tm.target_kv_bytes_per_token()


def draft_bytes(tokens: int) -> int:
    return blocks(tokens) * BLOCK_SIZE * tm.draft_kv_bytes_per_token()


def transfer_bytes(tokens: int) -> int:
    return target_bytes(tokens) + draft_bytes(tokens)
