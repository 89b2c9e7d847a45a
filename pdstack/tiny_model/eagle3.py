"""vLLM's Eagle3 draft forward (llama_eagle3.py) in plain PyTorch, over whole
sequences at once, so the draft's lm_head can be fitted on every decode
position of the probes in one pass.

It is a second implementation of vLLM's draft, so tests/test_eagle3_pin.py pins
it to vLLM's own Eagle3LlamaForCausalLM fed the same inputs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from pdstack.tiny_model import params
from pdstack.tiny_model.target import TargetTrace

if TYPE_CHECKING:
    import torch


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    import torch

    scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + params.RMS_NORM_EPS)
    return x * scale * weight


def _rope_neox(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Llama (neox-style) rotary embedding; x is [..., T, heads, head_dim]."""
    import torch

    dim = x.shape[-1]
    inv_freq = 1.0 / params.DRAFT_ROPE_THETA ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions.float()[..., None] * inv_freq  # [..., T, dim/2]
    cos, sin = angles.cos()[..., None, :], angles.sin()[..., None, :]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclasses.dataclass(frozen=True)
class DraftPass:
    """One draft forward over whole sequences, outputs kept from `start` on."""

    start: int
    normed: torch.Tensor  # [B, T - start, H], input to lm_head
    prenorm: torch.Tensor  # [B, T - start, H], hidden state for the next step
    keys: torch.Tensor  # [B, T, kv_heads, head_dim], after rope
    values: torch.Tensor  # [B, T, kv_heads, head_dim]


def _draft_qkv(
    w: dict[str, torch.Tensor],
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Eagle3 midlayer input: norm(embedding) next to hidden_norm(hidden)."""
    import torch

    embeds = _rms_norm(embeds, w["midlayer.input_layernorm.weight"])
    hidden = _rms_norm(hidden, w["midlayer.hidden_norm.weight"])
    x = torch.cat([embeds, hidden], dim=-1)
    shape = (*x.shape[:-1], -1, params.DRAFT_HEAD_DIM)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(shape)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(shape)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(shape)
    return _rope_neox(q, positions), _rope_neox(k, positions), v


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """GQA attention of q [B,Tq,h,d] over cached k, v [B,Tk,kvh,d] where mask
    [Tq,Tk] allows, plus optionally each query's own (k, v) [B,Tq,kvh,d]."""
    import torch

    rep = q.shape[-2] // k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1])
    k, v = k.repeat_interleave(rep, -2), v.repeat_interleave(rep, -2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    if own is not None:
        k_own, v_own = (t.repeat_interleave(rep, -2) for t in own)
        own_score = torch.einsum("bqhd,bqhd->bhq", q, k_own)[..., None] * scale
        scores = torch.cat([scores, own_score], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs[..., : k.shape[1]], v)
    if own is not None:
        out = out + probs[..., -1].transpose(1, 2)[..., None] * v_own
    return out.flatten(-2)


def _draft_tail(
    w: dict[str, torch.Tensor], attn: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """o_proj, post-attention norm, MLP and final norm, as in llama_eagle3.py."""
    import torch

    residual = attn @ w["midlayer.self_attn.o_proj.weight"].T + residual
    h = _rms_norm(residual, w["midlayer.post_attention_layernorm.weight"])
    gate = torch.nn.functional.silu(h @ w["midlayer.mlp.gate_proj.weight"].T)
    up = h @ w["midlayer.mlp.up_proj.weight"].T
    prenorm = (gate * up) @ w["midlayer.mlp.down_proj.weight"].T + residual
    return _rms_norm(prenorm, w["norm.weight"]), prenorm


def draft_first_pass(
    w: dict[str, torch.Tensor],
    embed: torch.Tensor,
    trace: TargetTrace,
    start: int,
    lose_prompt_kv: bool = False,
) -> DraftPass:
    """vLLM's first Eagle3 step over whole sequences: position j sees token j+1
    (the sampled token at the end) and fc(aux hidden states at j). Every
    position is a key; only positions >= start are needed as queries.

    lose_prompt_kv zeroes the cache before `start`, as a KV transfer that
    skipped the draft's layer would leave it (a negative control)."""
    import torch

    seq_len = trace.tokens.shape[1]
    next_tokens = torch.cat([trace.tokens[:, 1:], trace.greedy[:, -1:]], dim=1)
    hidden = trace.aux @ w["fc.weight"].T
    q, k, v = _draft_qkv(w, embed[next_tokens], hidden, torch.arange(seq_len))
    if lose_prompt_kv:
        k[:, :start], v[:, :start] = 0.0, 0.0
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()[start:]
    attn = _attend(q[:, start:], k, v, causal)
    normed, prenorm = _draft_tail(w, attn, hidden[:, start:])
    return DraftPass(start, normed, prenorm, k, v)


def draft_second_step(
    w: dict[str, torch.Tensor],
    embed: torch.Tensor,
    trace: TargetTrace,
    first: DraftPass,
) -> torch.Tensor:
    """Second draft position for every j in [start, T-1) at once, assuming the
    first guess was right: token = target greedy at j+1, hidden = the first
    step's prenorm output at j, position j+1, attending to the first pass's
    cache at 0..j plus itself. Returns lm_head inputs [B, T - 1 - start, H]."""
    import torch

    start, seq_len = first.start, trace.tokens.shape[1]
    q, k_own, v_own = _draft_qkv(
        w,
        embed[trace.greedy[:, start + 1 :]],
        first.prenorm[:, :-1],
        torch.arange(start + 1, seq_len),
    )
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()[start:-1]
    attn = _attend(q, first.keys, first.values, causal, own=(k_own, v_own))
    normed, _ = _draft_tail(w, attn, first.prenorm[:, :-1])
    return normed
