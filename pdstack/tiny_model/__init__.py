"""Tiny DeepSeek-V2 (MLA) target + Eagle3 draft, generated locally on first use.

The P/D stack needs a model pair that runs the real vLLM code paths on CPU
(MLA latent KV cache on the target, a GQA KV cache on the Eagle3 draft) without
any model hub. Weights are real random tensors from a fixed seed, so outputs are
deterministic and depend on every token of the prompt.

A random target is chaotic: its next token is a hash of the whole context, so no
small draft predicts it on unseen text (a refit head scores ~1/vocab there).
The draft's lm_head is therefore fitted to the target's greedy continuations of
a fixed probe set (see load_probes). On the probes the draft is accepted ~100%
iff target KV, draft KV and the aux hidden states are all exactly right, which
is what tests need from a detector; on other prompts acceptance is ~0.

    python -m pdstack.tiny_model [--cache-dir DIR]

Modules: params (every constant that shapes the files, and their stamp),
tokenizer, target, draft (checkpoint layout), eagle3 (vLLM's draft forward in
plain PyTorch), fit (the lm_head refit on the probes), cache (ensure_models);
mtp and mtp_cache: the tiny-mtp profile's target, whose own MTP layer is the
draft (ensure_mtp_model).
Heavy imports (torch, transformers) stay inside functions, so importing this
package for its constants is cheap.
"""

# The submodules are part of the interface (tests reach tiny_model.cache etc.).
from pdstack.tiny_model import cache, draft, eagle3, fit, params, target, tokenizer
from pdstack.tiny_model.cache import (
    Probe,
    TinyModels,
    ensure_models,
    layout_configs,
    load_probes,
)
from pdstack.tiny_model.draft import DraftCheckpointError, verify_draft_checkpoint
from pdstack.tiny_model.params import DTYPE, generator_stamp

__all__ = [
    "DTYPE",
    "DraftCheckpointError",
    "Probe",
    "TinyModels",
    "cache",
    "draft",
    "eagle3",
    "ensure_models",
    "fit",
    "generator_stamp",
    "layout_configs",
    "load_probes",
    "params",
    "target",
    "tokenizer",
    "verify_draft_checkpoint",
]
