"""The Eagle3 draft checkpoint: its config, the exact weight layout vLLM
loads, random initial weights, and saving with a layout check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdstack.tiny_model import params

if TYPE_CHECKING:
    import torch


class DraftCheckpointError(RuntimeError):
    """The draft checkpoint does not have exactly the weights vLLM needs."""


def draft_config(vocab_size: int, special_ids: dict[str, int]) -> dict[str, Any]:
    """config.json of the draft, as vLLM's Eagle3 Llama reads it."""
    return {
        "architectures": [params.DRAFT_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": params.TARGET_HIDDEN_SIZE,
        "target_hidden_size": params.TARGET_HIDDEN_SIZE,
        "intermediate_size": params.DRAFT_INTERMEDIATE_SIZE,
        "num_hidden_layers": params.DRAFT_NUM_LAYERS,
        "num_attention_heads": params.DRAFT_NUM_HEADS,
        "num_key_value_heads": params.DRAFT_NUM_KV_HEADS,
        "head_dim": params.DRAFT_HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": params.RMS_NORM_EPS,
        "max_position_embeddings": params.MAX_POSITION_EMBEDDINGS,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": params.DRAFT_ROPE_THETA,
        },
        # Same vocab as the target: no d2t/t2d maps are needed or loaded.
        "vocab_size": vocab_size,
        "draft_vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(params.EAGLE3_AUX_LAYERS),
            "use_aux_hidden_state": True,
        },
        "dtype": params.DTYPE,
        "torch_dtype": params.DTYPE,
        **special_ids,
    }


def expected_draft_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint keys vLLM's Eagle3LlamaForCausalLM loads (HF naming), with
    shapes. The embedding is deliberately absent: vLLM shares the target's."""
    hidden = config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, inter = config["head_dim"], config["intermediate_size"]
    n_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    layer = "midlayer."
    return {
        "fc.weight": (hidden, n_aux * config["target_hidden_size"]),
        f"{layer}input_layernorm.weight": (hidden,),
        f"{layer}hidden_norm.weight": (hidden,),
        # The single layer attends over [embedding, fc(aux)]: twice the width.
        f"{layer}self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        f"{layer}self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        f"{layer}self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        f"{layer}self_attn.o_proj.weight": (hidden, heads * head_dim),
        f"{layer}post_attention_layernorm.weight": (hidden,),
        f"{layer}mlp.gate_proj.weight": (inter, hidden),
        f"{layer}mlp.up_proj.weight": (inter, hidden),
        f"{layer}mlp.down_proj.weight": (hidden, inter),
        "norm.weight": (hidden,),
        "lm_head.weight": (config["draft_vocab_size"], hidden),
    }


def check_draft_weights(
    shapes: dict[str, tuple[int, ...]], config: dict[str, Any]
) -> None:
    """Raise DraftCheckpointError unless `shapes` matches what vLLM loads.

    vLLM never reports missing draft weights (Eagle3LlamaForCausalLM's
    load_weights returns None, so the loader's completeness check is skipped):
    a missing tensor would silently stay uninitialised."""
    expected = expected_draft_shapes(config)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = sorted(
        f"{k}: {tuple(shapes[k])} != {expected[k]}"
        for k in set(expected) & set(shapes)
        if tuple(shapes[k]) != expected[k]
    )
    if missing or unexpected or wrong:
        raise DraftCheckpointError(
            "draft checkpoint does not match Eagle3 Llama layout: "
            f"missing={missing} unexpected={unexpected} wrong_shape={wrong}"
        )


def verify_draft_checkpoint(path: Path) -> None:
    """Check a saved draft dir (config.json + model.safetensors); cheap, reads
    only the safetensors header."""
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text())
    shapes: dict[str, tuple[int, ...]] = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
            shapes[key] = tuple(f.get_slice(key).get_shape())
    check_draft_weights(shapes, config)


def init_draft_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Random draft weights; norms start at one like a freshly built model."""
    import torch

    gen = torch.Generator().manual_seed(params.SEED + 1)
    weights = {}
    for key, shape in expected_draft_shapes(config).items():
        if len(shape) == 1:
            weights[key] = torch.ones(shape)
        else:
            std = params.DRAFT_FC_STD if key == "fc.weight" else params.DRAFT_INIT_STD
            weights[key] = torch.randn(shape, generator=gen) * std
    return weights


def save_draft(
    config: dict[str, Any], weights: dict[str, torch.Tensor], out_dir: Path
) -> None:
    import torch
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    check_draft_weights({k: tuple(v.shape) for k, v in weights.items()}, config)
    dtype = getattr(torch, params.DTYPE)
    tensors = {k: v.to(dtype).contiguous() for k, v in sorted(weights.items())}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    verify_draft_checkpoint(out_dir)
