"""Which GPUs, and how many per role, a model needs: an estimate to plan with.

Per GPU of a role running tensor parallel N: 1/N of the weights, a reserve
for activations, CUDA graphs and NCCL, and the KV cache of at least one
``max-model-len`` sequence (an MLA latent is not split over ranks:
``pdstack.kv_layout``) must fit in ``gpu-memory-utilization`` of its memory.
vLLM's own memory profiling at start-up is the final word; this says before
a download which GPU class and N to plan for.

The weights' bytes come, best first, from the checkpoint's
``model.safetensors.index.json`` (``metadata.total_size``: exact), from the
caller, or from config.json: parameters counted layer by layer for
DeepSeek-style MLA/MoE and Llama-style models (checked against the
parameter counts their model cards publish), at the checkpoint's bytes per
parameter (``torch_dtype``, or ``quantization_config``'s).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdstack import kv_layout

GIB = 1 << 30
# GPU classes: name -> (memory.total as nvidia-smi reports it, MiB; capability).
GPUS: dict[str, tuple[int, str]] = {
    "A100 80GB": (81920, "sm80"),
    "H100 80GB": (81559, "sm90"),
    "H200": (143771, "sm90"),
    "B200": (183359, "sm100"),
}
# Activations, CUDA graphs, NCCL buffers per GPU: a planning reserve (vLLM
# measures the real figure in its profiling run).
RESERVE_GIB = 4.0
# vLLM 0.32's default gpu-memory-utilization (CacheConfig).
DEFAULT_UTILIZATION = 0.92
# Tensor-parallel widths tried: one host (up to 8), then two.
WIDTHS = (1, 2, 4, 8, 16)
HOST_GPUS = 8


@dataclass(frozen=True)
class Weights:
    bytes: int
    source: str  # where the figure came from


@dataclass(frozen=True)
class Fit:
    gpu: str
    width: int | None  # GPUs per role (tensor-parallel-size); None: none fits
    free_gib: float = 0.0  # per GPU, for the KV cache beyond one sequence
    kv_tokens: int = 0  # KV cache tokens that room holds


def params(config: Mapping[str, Any], mtp: bool = False) -> dict[str, int]:
    """Parameters by part (embeddings, attention, mlp, mtp) from config.json."""
    c = kv_layout.text_config(config)
    hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    vocab = int(c["vocab_size"])
    embed = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    attention = _attention(c, hidden)
    dense = 3 * hidden * int(c.get("intermediate_size") or 0)
    if experts := int(c.get("n_routed_experts") or 0):
        shared = int(c.get("n_shared_experts") or 0)
        moe = (experts + shared) * 3 * hidden * int(c["moe_intermediate_size"])
        moe += hidden * experts  # the router
        first_dense = int(c.get("first_k_dense_replace") or 0)
        mlp = first_dense * dense + (layers - first_dense) * moe
        last = moe
    else:
        mlp, last = layers * dense, dense
    parts = {"embeddings": embed, "attention": layers * attention, "mlp": mlp}
    if mtp and (extra := int(c.get("num_nextn_predict_layers") or 0)):
        # DeepSeek's MTP layer: a decoder layer, the projection of [embedding;
        # hidden], and its own embedding and head in the checkpoint.
        per_layer = attention + last + 2 * hidden * hidden + 2 * vocab * hidden
        parts["mtp"] = extra * per_layer
    return parts


def _attention(c: Mapping[str, Any], hidden: int) -> int:
    heads = int(c["num_attention_heads"])
    if kv_layout.is_mla(c):
        nope, rope = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"])
        v_dim, latent = int(c["v_head_dim"]), int(c["kv_lora_rank"])
        q_rank = int(c.get("q_lora_rank") or 0)
        q_out = heads * (nope + rope)
        q = hidden * q_rank + q_rank * q_out if q_rank else hidden * q_out
        kv = hidden * (latent + rope) + latent * heads * (nope + v_dim)
        return q + kv + heads * v_dim * hidden
    head = kv_layout.head_dim(c)
    return 2 * hidden * heads * head + 2 * hidden * kv_layout.kv_heads(c) * head


def bytes_per_param(config: Mapping[str, Any]) -> tuple[float, float]:
    """(linear layers, embeddings) bytes per parameter of the checkpoint."""
    c = kv_layout.text_config(config)
    dtype = str(c.get("torch_dtype") or c.get("dtype") or config.get("torch_dtype"))
    plain = float(kv_layout.DTYPE_BYTES.get(dtype, 2))
    quant = config.get("quantization_config") or c.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8":
        return 1.0, plain
    bits = quant.get("bits") or min(
        (
            int(group["weights"]["num_bits"])
            for group in (quant.get("config_groups") or {}).values()
            if isinstance(group, Mapping)
            and (group.get("weights") or {}).get("num_bits")
        ),
        default=None,
    )
    return (int(bits) / 8, plain) if bits else (plain, plain)


def weights(
    config_path: Path, config: Mapping[str, Any], mtp: bool, given_gib: float | None
) -> Weights:
    """The weights' bytes, from the best source there is (module docstring)."""
    if given_gib:
        return Weights(int(given_gib * GIB), "given")
    index = Path(config_path).with_name("model.safetensors.index.json")
    if index.is_file():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if total:
            return Weights(int(total), f"{index.name} (exact)")
    parts = params(config, mtp)
    linear, plain = bytes_per_param(config)
    total = (sum(parts.values()) - parts["embeddings"]) * linear
    total += parts["embeddings"] * plain
    if "mtp" in parts:  # its embedding and head are not quantized either
        vocab = int(kv_layout.text_config(config)["vocab_size"])
        hidden = int(kv_layout.text_config(config)["hidden_size"])
        total += 2 * vocab * hidden * (plain - linear)
    billions = sum(parts.values()) / 1e9
    return Weights(
        int(total), f"estimated from config.json: {billions:.1f}B parameters"
    )


def with_draft(target: Weights, draft: Mapping[str, Any]) -> Weights:
    """The target's weights and an Eagle draft's (one layer, its own head),
    where the draft's config.json says enough to count it."""
    try:
        parts = params(draft)
    except KeyError:
        return target
    c = kv_layout.text_config(draft)
    head = int(c.get("draft_vocab_size") or c["vocab_size"]) * int(c["hidden_size"])
    # Eagle3: no embedding of its own (the target's), a fused input layer.
    count = parts["attention"] + parts["mlp"] + head + 3 * int(c["hidden_size"]) ** 2
    extra = int(count * bytes_per_param(draft)[1])
    return Weights(target.bytes + extra, f"{target.source}, with the draft")


def fits(
    weight_bytes: int,
    kv_bytes_per_token: int,
    max_model_len: int,
    heads: int,
    utilization: float = DEFAULT_UTILIZATION,
) -> list[Fit]:
    """For each GPU class, the fewest GPUs per role that hold the model.

    ``kv_bytes_per_token``: on one rank at tensor parallel 1 (the MLA part
    stays whole on every rank, a GQA part splits; close enough to plan)."""
    out = []
    for gpu, (mib, _) in GPUS.items():
        usable = mib / 1024 * utilization
        found = Fit(gpu, None)
        for width in WIDTHS:
            if heads % width:
                continue  # vLLM splits the attention heads evenly
            sequence = kv_bytes_per_token * max(max_model_len, 1) / GIB
            free = usable - weight_bytes / width / GIB - RESERVE_GIB - sequence
            if free >= 0:
                tokens = int(free * GIB // max(kv_bytes_per_token, 1))
                found = Fit(gpu, width, round(free, 1), tokens + max_model_len)
                break
        out.append(found)
    return out


def describe(fit: Fit) -> str:
    if fit.width is None:
        return f"{fit.gpu}: does not fit on {WIDTHS[-1]} GPUs"
    where = "one host" if fit.width <= HOST_GPUS else "more than one host per role"
    return (
        f"{fit.gpu}: {fit.width} per role ({where}); KV cache for about "
        f"{fit.kv_tokens:,} tokens per GPU ({fit.free_gib} GiB beyond one sequence)"
    )


def start_budget_s(weight_bytes: int) -> int:
    """Seconds a server may take to start: a cold download at 100 MB/s (a
    1 Gbit/s link, shared) plus 20 min to load, compile and capture CUDA
    graphs, rounded up to half hours; 30 min at least (compose's default)."""
    seconds = weight_bytes / 100e6 + 20 * 60
    return max(1800, math.ceil(seconds / 1800) * 1800)


def duration(seconds: int) -> str:
    """Compose's and Kubernetes' way to write it: 2h30m, 30m."""
    hours, minutes = divmod(seconds // 60, 60)
    return (
        f"{hours}h{minutes}m"
        if hours and minutes
        else f"{hours}h"
        if hours
        else f"{minutes}m"
    )
