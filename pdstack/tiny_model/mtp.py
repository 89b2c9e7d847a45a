"""The tiny-mtp model: a DeepSeek-V3 (MLA) target carrying one MTP layer
(``num_nextn_predict_layers: 1``), the draft vLLM's ``mtp`` method runs.

vLLM (deepseek_mtp.py) loads the MTP layer from the target's own checkpoint,
at layer index num_hidden_layers: ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head`` and a whole DeepSeek decoder layer (``mtp_block``, MLA
attention with a KV cache layer of its own). At position j it sees
eh_proj([enorm(embed(token j+1)), hnorm(target's final hidden state at j)])
and predicts token j+2 through the target's lm_head (vLLM always shares the
target's lm_head and embedding with an MTP draft, so neither can be fitted).

As for the Eagle3 draft (see the package docstring) only a fit on probes can
make a draft of a random target accepted: here the MTP block's MLP down_proj,
the last free linear map before the shared lm_head. eh_proj is tiny
(MTP_EH_STD), so the residual stream leaving the attention is its output:
the guess rests on the MTP layer's own KV cache of the prompt, which P/D must
transfer, and a draft without it guesses wrong.

The MTP block is the target's own decoder layer class (transformers'
DeepseekV3DecoderLayer, as vLLM uses its DeepseekV2DecoderLayer), so the fit
runs the same forward as the target without a second implementation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdstack.tiny_model import params
from pdstack.tiny_model.fit import probe_group
from pdstack.tiny_model.target import config_fields
from pdstack.tiny_model.tokenizer import SPECIAL_IDS, special_ids

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast

# Bump whenever generation logic changes in a way that changes the files. The
# stamp also hashes params (the tiny pair's constants: tokenizer, shapes,
# probes), so a change there regenerates this model too.
MTP_GENERATOR_VERSION = 1
MTP_LAYERS = 1
# As DRAFT_FC_STD for Eagle3: eh_proj's output is ~1e-2 per dim against the
# attention output's ~1, so the MTP layer's guess rests on its KV cache.
MTP_EH_STD = 3e-4
MTP_FIT_STEPS = 400
MTP_FIT_LR = 0.02
MTP_FIT_RIDGE = 1e-2
MTP_LOGIT_SCALE = 8.0  # ridge targets: this many lm_head rows' norms


def mtp_config_fields() -> dict[str, Any]:
    """The target's config.json fields but the tokenizer's (see
    target.config_fields), with its MTP layer."""
    return {
        **config_fields(),
        # The MTP layer is layer num_hidden_layers: dense like the others.
        "first_k_dense_replace": params.TARGET_NUM_LAYERS + MTP_LAYERS,
        "num_nextn_predict_layers": MTP_LAYERS,
        "n_group": 1,
        "topk_group": 1,
    }


def mtp_stamp() -> str:
    """Stable hash of what shapes the files; names the cache directory."""
    consts = {k: v for k, v in globals().items() if k.startswith("MTP_")}
    blob = json.dumps(
        {"tiny": params.generator_params(), "mtp": consts},
        sort_keys=True,
        default=list,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def build_mtp_target(tokenizer: PreTrainedTokenizerFast) -> tuple[Any, Any]:
    """DeepseekV3ForCausalLM (L layers) and its MTP decoder layer (index L),
    built as one L+1-layer model from the seed so the MTP block is initialised
    exactly like the target's layers."""
    import torch
    from transformers.models.deepseek_v3 import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    fields = mtp_config_fields()
    fields["num_hidden_layers"] += MTP_LAYERS
    config = DeepseekV3Config(
        vocab_size=len(tokenizer),
        attn_implementation="eager",
        **fields,
        **special_ids(tokenizer),
    )
    torch.manual_seed(params.SEED)
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    block = model.model.layers[params.TARGET_NUM_LAYERS]
    model.model.layers = model.model.layers[: params.TARGET_NUM_LAYERS]
    model.config.num_hidden_layers = params.TARGET_NUM_LAYERS
    model.config.architectures = ["DeepseekV3ForCausalLM"]
    model.config.dtype = torch.float32
    with torch.no_grad():
        # As target.build_target: greedy decoding never stops early.
        for token_id in special_ids(tokenizer).values():
            model.lm_head.weight[token_id].zero_()
    return model, block


def init_mtp_head(hidden: int) -> dict[str, torch.Tensor]:
    """The MTP layer's own weights next to its decoder layer."""
    import torch

    gen = torch.Generator().manual_seed(params.SEED + 3)
    return {
        "enorm.weight": torch.ones(hidden),
        "hnorm.weight": torch.ones(hidden),
        "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) * MTP_EH_STD,
        "shared_head.norm.weight": torch.ones(hidden),
    }


@dataclasses.dataclass(frozen=True)
class Trace:
    """A batch of prompts continued greedily by the target."""

    tokens: torch.Tensor  # [B, T] prompt then greedy continuation
    hidden: torch.Tensor  # [B, T, H] final (normed) hidden state, vLLM's input
    last: torch.Tensor  # [B] the target's greedy token after tokens[:, -1]


def trace(model: Any, prompts: torch.Tensor, steps: int) -> Trace:
    import torch

    nxt, past, tokens = prompts, None, [prompts]
    for _ in range(steps):
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        tokens.append(nxt)
    seq = torch.cat(tokens, 1)
    out = model(input_ids=seq, output_hidden_states=True)
    return Trace(seq, out.hidden_states[-1], out.logits[:, -1].argmax(-1))


def mtp_block_inputs(
    model: Any, block: Any, head: dict[str, torch.Tensor], tr: Trace
) -> tuple[torch.Tensor, torch.Tensor]:
    """(down_proj's input [B,T,I], the residual it is added to [B,T,H]) of the
    MTP layer at every position, as vLLM runs it over the whole sequence."""
    import torch

    seq_len = tr.tokens.shape[1]
    positions = torch.arange(seq_len)[None].expand(tr.tokens.shape[0], -1)
    next_tokens = torch.cat([tr.tokens[:, 1:], tr.last[:, None]], dim=1)
    embeds = model.model.embed_tokens(next_tokens)
    embeds = torch.where(positions[..., None] == 0, 0.0, embeds)  # as vLLM
    norm = model.model.norm  # same RMSNorm class; weights swapped in below

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return x * scale * weight

    x = torch.cat(
        [rms(embeds, head["enorm.weight"]), rms(tr.hidden, head["hnorm.weight"])], -1
    )
    x = x @ head["eh_proj.weight"].T
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        block.post_attention_layernorm.register_forward_hook(
            lambda _m, args, _o: seen.__setitem__("residual", args[0])
        ),
        block.mlp.down_proj.register_forward_hook(
            lambda _m, args, _o: seen.__setitem__("features", args[0])
        ),
    ]
    try:
        mask = torch.full((seq_len, seq_len), float("-inf")).triu(1)[None, None]
        block(
            x,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=model.model.rotary_emb(x, positions),
        )
    finally:
        for hook in hooks:
            hook.remove()
    return seen["features"], seen["residual"]


def _logits(
    down: torch.Tensor, feats: torch.Tensor, resid: torch.Tensor, lm_head: torch.Tensor
) -> torch.Tensor:
    """What vLLM's compute_logits makes of the MTP layer's output
    (shared_head.norm is all ones, the target's lm_head)."""
    import torch

    h = resid + feats @ down.T
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + params.RMS_NORM_EPS)
    return h @ lm_head.T


def fit_down_proj(
    feats: torch.Tensor,
    resid: torch.Tensor,
    labels: torch.Tensor,
    lm_head: torch.Tensor,
) -> torch.Tensor:
    """Ridge onto the label's lm_head row (scaled past the residual), then
    full-batch Adam on cross-entropy through the fixed norm and lm_head."""
    import torch

    rows = lm_head[labels]
    scale = (
        MTP_LOGIT_SCALE
        * resid.norm(dim=-1, keepdim=True)
        / rows.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    )
    goal = rows * scale - resid
    gram = feats.T @ feats + MTP_FIT_RIDGE * torch.eye(feats.shape[1])
    down = torch.linalg.solve(gram, feats.T @ goal).T.contiguous()  # [H, I]
    down.requires_grad_(True)
    opt = torch.optim.Adam([down], lr=MTP_FIT_LR)
    for _ in range(MTP_FIT_STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            _logits(down, feats, resid, lm_head), labels
        )
        loss.backward()
        opt.step()
    return down.detach()


def build_mtp(
    tokenizer: PreTrainedTokenizerFast, progress: Callable[[str], None]
) -> tuple[Any, dict[str, torch.Tensor], list[dict], dict]:
    """The target, its MTP layer's weights (checkpoint names), the probes and
    the fit report."""
    import torch

    model, block = build_mtp_target(tokenizer)
    hidden = params.TARGET_HIDDEN_SIZE
    head = init_mtp_head(hidden)
    lm_head = model.lm_head.weight.detach()
    gen = torch.Generator().manual_seed(params.SEED + 2)
    samples, probes = [], []
    for length, count in params.PROBE_GROUPS:
        prompts = probe_group(tokenizer, length, count, gen)
        progress(f"  probes: {count} x {length} tokens + {params.PROBE_MAX_TOKENS}")
        with torch.no_grad():
            tr = trace(model, prompts, params.PROBE_MAX_TOKENS)
            feats, resid = mtp_block_inputs(model, block, head, tr)
        # Position j guesses token j+2; vLLM verifies guesses made from the
        # last prompt position on.
        start = length - 1
        samples.append(
            (
                feats[:, start:-2].flatten(0, 1),
                resid[:, start:-2].flatten(0, 1),
                tr.tokens[:, start + 2 :].flatten(),
            )
        )
        probes += [
            {"prompt": p.tolist(), "greedy": c.tolist()}
            for p, c in zip(prompts, tr.tokens[:, length:], strict=True)
        ]
    feats, resid, labels = map(torch.cat, zip(*samples, strict=True))
    progress(f"  fitting the MTP layer's down_proj on {len(labels)} samples")
    down = fit_down_proj(feats, resid, labels, lm_head)
    with torch.no_grad():
        block.mlp.down_proj.weight.copy_(down)
        acc = (_logits(down, feats, resid, lm_head).argmax(-1) == labels).float()
    weights = {
        **{f"mtp_block.{k}": v for k, v in block.state_dict().items()},
        **head,
        "shared_head.head.weight": lm_head.clone(),
    }
    report = {"samples": len(labels), "train_acc": acc.mean().item()}
    return model, weights, probes, report


def save_mtp_target(model: Any, mtp_weights: dict[str, Any], out_dir: Path) -> None:
    """The target's checkpoint with the MTP layer's tensors under
    model.layers.<num_hidden_layers>. (vLLM's layout: the decoder layer's
    tensors without the mtp_block prefix, which vLLM adds back)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    model.save_pretrained(out_dir)
    ids = {k: getattr(model.config, k) for k in SPECIAL_IDS}
    GenerationConfig(**ids).save_pretrained(out_dir)
    path = out_dir / "model.safetensors"
    tensors = load_file(str(path))
    prefix = f"model.layers.{params.TARGET_NUM_LAYERS}."
    for name, value in mtp_weights.items():
        key = prefix + name.removeprefix("mtp_block.")
        tensors[key] = value.to(torch.float32).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
