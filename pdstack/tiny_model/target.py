"""The DeepSeek-V2 (MLA) target, and its activations as vLLM hands them to
the Eagle3 draft."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdstack.tiny_model import params
from pdstack.tiny_model.tokenizer import SPECIAL_IDS, special_ids

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast


def config_fields() -> dict[str, Any]:
    """The target's config.json fields but the tokenizer's (vocabulary size,
    special token ids): pure, so the e2e suite and the bench read the pair's
    KV layout without generating it (a client venv has no torch)."""
    return dict(
        hidden_size=params.TARGET_HIDDEN_SIZE,
        intermediate_size=params.TARGET_INTERMEDIATE_SIZE,
        num_hidden_layers=params.TARGET_NUM_LAYERS,
        num_attention_heads=params.TARGET_NUM_HEADS,
        num_key_value_heads=params.TARGET_NUM_HEADS,
        kv_lora_rank=params.TARGET_KV_LORA_RANK,
        q_lora_rank=None,
        qk_rope_head_dim=params.TARGET_QK_ROPE_HEAD_DIM,
        qk_nope_head_dim=params.TARGET_QK_NOPE_HEAD_DIM,
        v_head_dim=params.TARGET_V_HEAD_DIM,
        # Dense MLP everywhere: vLLM's CPU MoE path is not what we test.
        # The MoE fields must still be ints; they describe no layer.
        first_k_dense_replace=params.TARGET_NUM_LAYERS,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        max_position_embeddings=params.MAX_POSITION_EMBEDDINGS,
        initializer_range=params.TARGET_INITIALIZER_RANGE,
        rms_norm_eps=params.RMS_NORM_EPS,
        rope_parameters=dict(params.TARGET_ROPE_PARAMETERS),
        tie_word_embeddings=False,
    )


def build_target(tokenizer: PreTrainedTokenizerFast) -> Any:
    """DeepseekV2ForCausalLM with MLA, YaRN, dense MLPs and random weights."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=len(tokenizer),
        attn_implementation="eager",
        **config_fields(),
        **special_ids(tokenizer),
    )
    config.architectures = ["DeepseekV2ForCausalLM"]
    config.dtype = torch.float32
    torch.manual_seed(params.SEED)
    model = DeepseekV2ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        # Special tokens get a zero logit while the others are ~N(0, 5): greedy
        # decoding never stops early, so output lengths stay deterministic.
        for token_id in special_ids(tokenizer).values():
            model.lm_head.weight[token_id].zero_()
    return model


def save_target(model: Any, out_dir: Path) -> None:
    from transformers import GenerationConfig

    model.save_pretrained(out_dir)
    # Only token ids: vLLM copies sampling fields from here into its defaults.
    ids = {k: getattr(model.config, k) for k in SPECIAL_IDS}
    GenerationConfig(**ids).save_pretrained(out_dir)


@dataclasses.dataclass(frozen=True)
class TargetTrace:
    """Target activations over a batch of equal-length sequences."""

    tokens: torch.Tensor  # [B, T]
    aux: torch.Tensor  # [B, T, 3 * hidden], residual stream entering aux layers
    greedy: torch.Tensor  # [B, T], argmax next token after each position


def greedy_trace(model: Any, prompts: torch.Tensor, steps: int) -> TargetTrace:
    """Append `steps` greedy tokens, as vLLM decodes at temperature 0, keeping
    what vLLM hands the Eagle3 draft.

    vLLM's DeepseekV2Model records `hidden_states + residual` just before layer
    idx runs, i.e. the residual stream entering layer idx; in HF terms that is
    output_hidden_states[idx] (index 0 is the embedding output)."""
    import torch

    tokens, aux, greedy = [], [], []
    nxt, past = prompts, None
    for _ in range(steps + 1):
        out = model(
            input_ids=nxt,
            past_key_values=past,
            use_cache=True,
            output_hidden_states=True,
        )
        past = out.past_key_values
        tokens.append(nxt)
        aux.append(
            torch.cat([out.hidden_states[i] for i in params.EAGLE3_AUX_LAYERS], -1)
        )
        greedy.append(out.logits.argmax(-1))
        nxt = greedy[-1][:, -1:]
    return TargetTrace(torch.cat(tokens, 1), torch.cat(aux, 1), torch.cat(greedy, 1))
