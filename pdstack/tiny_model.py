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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy imports stay lazy so the constants are cheap to import
    import torch
    from transformers import PreTrainedTokenizerFast

# Bump whenever generation logic changes in a way that changes the files.
GENERATOR_VERSION = 1
SEED = 20240611

DTYPE = "float32"
DTYPE_BYTES = 4

# --- target: DeepSeek-V2 with MLA ---------------------------------------------
TARGET_NUM_LAYERS = 8  # Eagle3 reads layers (2, L//2, L-3): needs L >= 8
TARGET_HIDDEN_SIZE = 256
TARGET_NUM_HEADS = 4
TARGET_INTERMEDIATE_SIZE = 512
# vLLM's CPU MLA kernel only supports a 576-wide latent (512 + 64).
TARGET_KV_LORA_RANK = 512
TARGET_QK_ROPE_HEAD_DIM = 64
TARGET_QK_NOPE_HEAD_DIM = 64
TARGET_V_HEAD_DIM = 64
# A benchmark sends 4096-token prompts plus the generated tokens.
MAX_POSITION_EMBEDDINGS = 8192
# 0.02 makes every prompt decode to the same token; 0.3 keeps them distinct.
TARGET_INITIALIZER_RANGE = 0.3
RMS_NORM_EPS = 1e-6
# Same YaRN settings as real DeepSeek checkpoints; plain RoPE with MLA on the
# vLLM CPU backend gives batch-shape-dependent outputs.
TARGET_ROPE_PARAMETERS: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
EAGLE3_AUX_LAYERS = (2, TARGET_NUM_LAYERS // 2, TARGET_NUM_LAYERS - 3)

# --- draft: Llama-style Eagle3 head with GQA ----------------------------------
DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
DRAFT_NUM_LAYERS = 1
DRAFT_NUM_HEADS = 4
DRAFT_NUM_KV_HEADS = 2
DRAFT_HEAD_DIM = 64
DRAFT_INTERMEDIATE_SIZE = 512
DRAFT_INIT_STD = 0.3  # as the target: the refit only needs distinct features
# The target's aux states have RMS ~150-250, so fc(aux) comes out ~1 per dim,
# small next to the attention output: the draft's guess then rests on its own
# KV cache of the prompt, and a draft fed wrong KV guesses wrong.
DRAFT_FC_STD = 3e-4
DRAFT_ROPE_THETA = 10000.0

# --- tokenizer ----------------------------------------------------------------
TOKENIZER_VOCAB_SIZE = 1024  # min_frequency=1 lets the small corpus fill it
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

# --- draft refit data (see the module docstring) ------------------------------
# (prompt length in tokens incl. BOS, number of prompts); English/random alternate
PROBE_GROUPS = ((16, 8), (32, 8), (48, 8), (64, 8), (128, 4), (256, 2), (1024, 2))
PROBE_MAX_TOKENS = 64  # continuation fitted per probe; longer outputs fall off
PROBE_FILE = "probe_prompts.json"
FIT_RIDGE = 1e-2
FIT_CE_STEPS = 200
FIT_CE_LR = 0.05
FIT_STEP2_WEIGHT = 0.5  # lm_head is shared by both draft positions

STAMP_FILE = "pd-tiny-stamp.json"
STALE_TEMP_S = 3600.0

CORPUS = """\
The morning train left the station a few minutes late, and most of the people
on board were still holding cups of coffee. A woman near the window was reading
a long report about water prices, while her son counted the bridges they passed.
The river was high after a week of rain, and the fields on both sides looked
bright green. When the train slowed down near the old mill, the boy asked why
the wheel no longer turned. His mother said that the mill had closed many years
ago, but the town kept the building because visitors liked to take pictures.
In the kitchen of a small restaurant, the cook was cutting onions and carrots
for the soup of the day. She added salt, pepper, a little butter and a handful
of fresh herbs from the garden behind the house. The soup needed to simmer for
an hour, so she started on the bread. Flour, water, yeast and a pinch of sugar
went into the large bowl, and she worked the dough until it was smooth and soft.
A computer program is a list of instructions that tells a machine what to do.
Some programs are short and simple, like a script that renames files in a
folder. Others are very large systems that serve millions of requests every
day. Engineers measure how long each request takes, how much memory the server
uses, and how often something goes wrong. When a cache is warm, a request can
finish quickly; when the cache is cold, the server has to compute everything
again, and the user waits longer for the answer.
The library opened at nine o'clock on weekdays and at ten on Saturday. Students
came early to find a quiet table near the windows. The history section was on
the second floor, next to a collection of maps that showed how the coast had
changed over three hundred years. An old man visited every Tuesday to read the
newspaper and to talk with the librarian about birds, the weather, and the
price of apples at the market.
Spring arrived slowly in the mountains. Snow stayed on the northern slopes until
the end of April, but the valleys filled with flowers and the streams ran fast
and cold. Hikers set out before sunrise to reach the lake by noon. They carried
water, a map, warm clothes and a small stove to make tea. On clear days they
could see three countries from the top of the ridge.
Good writing is clear, short and honest. A writer should know what she wants to
say before she starts, and she should choose simple words when simple words are
enough. Reading a draft aloud helps to find sentences that are too long. It is
also useful to ask a friend for an opinion, because other people notice
problems that the author can no longer see.
The city council met on Thursday evening to discuss the new bus lines, the
repair of the main square, and a plan to plant two thousand trees along the
river. Several people asked questions about the cost. The mayor answered that
the trees would be paid for by a grant, and that the work would start in the
autumn, when the ground is soft and the weather is mild.
Numbers tell stories too. One, two, three, four, five, six, seven, eight, nine
and ten are the first words many children learn to count. Later they learn that
a dozen is twelve, that a century is one hundred years, and that a thousand
grams make one kilogram. Some of them grow up to study physics, chemistry,
biology or mathematics, and they use numbers every day at work.
A language model reads a prompt, one token at a time, and predicts the next
token. The server that computes the prompt is called the prefill server; the
server that generates the answer is called the decode server. Between them, the
key and value cache of every layer travels over the network, so the decode
server does not have to compute the prompt again. Operators watch the latency
of each request, the throughput of the cluster, the memory of each machine, and
the number of bytes that were sent and received. When a transfer fails, the
request is retried, and a report explains what went wrong and why.
The weather report for the weekend promised sunshine on Saturday and strong wind
with heavy rain on Sunday. Farmers hurried to bring in the hay, fishermen stayed
in the harbour, and children played football in the park until it was dark. On
Monday morning the streets were wet, the air smelled of leaves, and everybody
talked about the storm while they waited for the bus to arrive.
"""


@dataclasses.dataclass(frozen=True)
class TinyModels:
    """Paths of a generated model pair (HF directories loadable by vLLM)."""

    target: Path
    draft: Path


@dataclasses.dataclass(frozen=True)
class Probe:
    """A prompt the draft was fitted on, with the target's greedy continuation
    (HF, float32). Send `prompt` as token ids with max_tokens <= len(greedy)."""

    prompt: list[int]
    greedy: list[int]


def load_probes(models: TinyModels) -> list[Probe]:
    """The probe set saved next to the draft (see PROBE_GROUPS)."""
    data = json.loads((models.draft / PROBE_FILE).read_text())
    return [Probe(p["prompt"], p["greedy"]) for p in data["probes"]]


class DraftCheckpointError(RuntimeError):
    """The draft checkpoint does not have exactly the weights vLLM needs."""


def _generator_params() -> dict[str, Any]:
    """Everything that determines the generated files."""
    names = sorted(
        name
        for name, value in globals().items()
        if name.isupper()
        and isinstance(value, (int, float, str, tuple, dict))
        and name not in {"CORPUS", "STAMP_FILE", "STALE_TEMP_S", "TYPE_CHECKING"}
    )
    params = {name: globals()[name] for name in names}
    params["CORPUS_SHA256"] = hashlib.sha256(CORPUS.encode()).hexdigest()
    return params


def generator_stamp() -> str:
    """Stable hash of the generator's parameters; names the cache directory."""
    blob = json.dumps(_generator_params(), sort_keys=True, default=list)
    return hashlib.sha256(blob.encode()).hexdigest()


def default_cache_dir() -> Path:
    env = os.environ.get("PD_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/pd-mooncake/models").expanduser()


# --- determinism --------------------------------------------------------------
@contextlib.contextmanager
def _deterministic_torch() -> Iterator[None]:
    """Single-threaded deterministic kernels: float reductions then do not
    depend on how many cores the machine has, so files are byte-identical."""
    import torch

    threads = torch.get_num_threads()
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(was_deterministic)


# --- tokenizer ----------------------------------------------------------------
def build_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on CORPUS: any text encodes without unknowns."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Prepend BOS like DeepSeek tokenizers do, so prompts start the same way.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out_dir)
    return fast


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return {
        "bos_token_id": tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        "eos_token_id": tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    }


# --- target -------------------------------------------------------------------
def build_target(tokenizer: PreTrainedTokenizerFast) -> Any:
    """DeepseekV2ForCausalLM with MLA, YaRN, dense MLPs and random weights."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=len(tokenizer),
        hidden_size=TARGET_HIDDEN_SIZE,
        intermediate_size=TARGET_INTERMEDIATE_SIZE,
        num_hidden_layers=TARGET_NUM_LAYERS,
        num_attention_heads=TARGET_NUM_HEADS,
        num_key_value_heads=TARGET_NUM_HEADS,
        kv_lora_rank=TARGET_KV_LORA_RANK,
        q_lora_rank=None,
        qk_rope_head_dim=TARGET_QK_ROPE_HEAD_DIM,
        qk_nope_head_dim=TARGET_QK_NOPE_HEAD_DIM,
        v_head_dim=TARGET_V_HEAD_DIM,
        # Dense MLP everywhere: vLLM's CPU MoE path is not what we test.
        # The MoE fields must still be ints; they describe no layer.
        first_k_dense_replace=TARGET_NUM_LAYERS,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=TARGET_INITIALIZER_RANGE,
        rms_norm_eps=RMS_NORM_EPS,
        rope_parameters=dict(TARGET_ROPE_PARAMETERS),
        tie_word_embeddings=False,
        attn_implementation="eager",
        **_special_ids(tokenizer),
    )
    config.architectures = ["DeepseekV2ForCausalLM"]
    config.dtype = torch.float32
    torch.manual_seed(SEED)
    model = DeepseekV2ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        # Special tokens get a zero logit while the others are ~N(0, 5): greedy
        # decoding never stops early, so output lengths stay deterministic.
        for token_id in _special_ids(tokenizer).values():
            model.lm_head.weight[token_id].zero_()
    return model


def save_target(model: Any, out_dir: Path) -> None:
    from transformers import GenerationConfig

    model.save_pretrained(out_dir)
    # Only token ids: vLLM copies sampling fields from here into its defaults.
    GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    ).save_pretrained(out_dir)


# --- capture target hidden states ---------------------------------------------
@dataclasses.dataclass(frozen=True)
class TargetTrace:
    """Target activations over a batch of equal-length sequences."""

    tokens: torch.Tensor  # [B, T]
    aux: torch.Tensor  # [B, T, 3 * hidden], residual stream entering aux layers
    greedy: torch.Tensor  # [B, T], argmax next token after each position


def _probe_group(
    tokenizer: PreTrainedTokenizerFast, length: int, count: int, gen: torch.Generator
) -> torch.Tensor:
    """`count` prompts of `length` tokens: BOS, then alternately an English
    window of the corpus and uniformly random tokens. [count, length]"""
    import torch

    bos = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    corpus = torch.tensor(tokenizer(CORPUS, add_special_tokens=False).input_ids)
    # Tiled so windows longer than the corpus still read as running text.
    corpus = corpus.repeat(length // len(corpus) + 2)
    low = len(SPECIAL_TOKENS)  # special tokens were added first: ids 0..2
    rows = []
    for i in range(count):
        if i % 2 == 0:
            start = int(torch.randint(0, len(corpus) - length, (1,), generator=gen))
            body = corpus[start : start + length - 1]
        else:
            body = torch.randint(low, len(tokenizer), (length - 1,), generator=gen)
        rows.append(torch.cat([torch.tensor([bos]), body]))
    return torch.stack(rows)


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
        aux.append(torch.cat([out.hidden_states[i] for i in EAGLE3_AUX_LAYERS], -1))
        greedy.append(out.logits.argmax(-1))
        nxt = greedy[-1][:, -1:]
    return TargetTrace(torch.cat(tokens, 1), torch.cat(aux, 1), torch.cat(greedy, 1))


# --- draft --------------------------------------------------------------------
def draft_config(vocab_size: int, special_ids: dict[str, int]) -> dict[str, Any]:
    """config.json of the draft, as vLLM's Eagle3 Llama reads it."""
    return {
        "architectures": [DRAFT_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": TARGET_HIDDEN_SIZE,
        "target_hidden_size": TARGET_HIDDEN_SIZE,
        "intermediate_size": DRAFT_INTERMEDIATE_SIZE,
        "num_hidden_layers": DRAFT_NUM_LAYERS,
        "num_attention_heads": DRAFT_NUM_HEADS,
        "num_key_value_heads": DRAFT_NUM_KV_HEADS,
        "head_dim": DRAFT_HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_NORM_EPS,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rope_parameters": {"rope_type": "default", "rope_theta": DRAFT_ROPE_THETA},
        # Same vocab as the target: no d2t/t2d maps are needed or loaded.
        "vocab_size": vocab_size,
        "draft_vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(EAGLE3_AUX_LAYERS),
            "use_aux_hidden_state": True,
        },
        "dtype": DTYPE,
        "torch_dtype": DTYPE,
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

    gen = torch.Generator().manual_seed(SEED + 1)
    weights = {}
    for key, shape in expected_draft_shapes(config).items():
        if len(shape) == 1:
            weights[key] = torch.ones(shape)
        else:
            std = DRAFT_FC_STD if key == "fc.weight" else DRAFT_INIT_STD
            weights[key] = torch.randn(shape, generator=gen) * std
    return weights


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_NORM_EPS) * weight


def _rope_neox(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Llama (neox-style) rotary embedding; x is [..., T, heads, head_dim]."""
    import torch

    dim = x.shape[-1]
    inv_freq = 1.0 / DRAFT_ROPE_THETA ** (torch.arange(0, dim, 2).float() / dim)
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

    x = torch.cat(
        [
            _rms_norm(embeds, w["midlayer.input_layernorm.weight"]),
            _rms_norm(hidden, w["midlayer.hidden_norm.weight"]),
        ],
        dim=-1,
    )
    shape = (*x.shape[:-1], -1, DRAFT_HEAD_DIM)
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
    mlp = (gate * (h @ w["midlayer.mlp.up_proj.weight"].T)) @ w[
        "midlayer.mlp.down_proj.weight"
    ].T
    prenorm = mlp + residual
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


def draft_training_set(
    w: dict[str, torch.Tensor], embed: torch.Tensor, trace: TargetTrace, start: int
) -> tuple[torch.Tensor, ...]:
    """(features, labels, weights) at the decode positions j >= start.

    Position 0 at j predicts the target's greedy token after j+1; position 1
    (given position 0 was accepted) the one after that. Earlier positions are
    left out: vLLM only verifies drafts made after the prompt."""
    import torch

    first = draft_first_pass(w, embed, trace, start)
    second = draft_second_step(w, embed, trace, first)
    f0 = first.normed[:, :-1].flatten(0, 1)
    y0 = trace.greedy[:, start + 1 :].flatten()
    f1 = second[:, :-1].flatten(0, 1)
    y1 = trace.greedy[:, start + 2 :].flatten()
    weights = torch.cat([torch.ones(len(y0)), torch.full((len(y1),), FIT_STEP2_WEIGHT)])
    return torch.cat([f0, f1]), torch.cat([y0, y1]), weights


def fit_lm_head(
    features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Ridge regression onto one-hot labels, then full-batch Adam on weighted
    cross-entropy: ridge gets the directions, CE sharpens the argmax."""
    import torch

    onehot = torch.nn.functional.one_hot(labels, vocab).float()
    wf = features * weights[:, None]
    gram = features.T @ wf + FIT_RIDGE * torch.eye(features.shape[1])
    head = torch.linalg.solve(gram, wf.T @ onehot).T.contiguous()  # [V, H]
    head.requires_grad_(True)
    opt = torch.optim.Adam([head], lr=FIT_CE_LR)
    for _ in range(FIT_CE_STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            features @ head.T, labels, reduction="none"
        )
        (loss * weights).sum().div(weights.sum()).backward()
        opt.step()
    return head.detach()


def _accuracy(
    head: torch.Tensor, features: torch.Tensor, labels: torch.Tensor
) -> float:
    return ((features @ head.T).argmax(-1) == labels).float().mean().item()


# --- orchestration ------------------------------------------------------------
def _probe_groups(tokenizer: PreTrainedTokenizerFast) -> list[torch.Tensor]:
    """The fixed probe set, one [count, length] tensor per PROBE_GROUPS entry."""
    import torch

    gen = torch.Generator().manual_seed(SEED + 2)
    return [_probe_group(tokenizer, n, count, gen) for n, count in PROBE_GROUPS]


@dataclasses.dataclass(frozen=True)
class FitSamples:
    features: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    continuations: torch.Tensor  # [count, PROBE_MAX_TOKENS] target greedy tokens


def _fit_samples(
    model: Any, weights: dict[str, torch.Tensor], prompts: torch.Tensor
) -> FitSamples:
    """Greedy-continue one probe group with the target and turn it into draft
    training samples."""
    import torch

    embed = model.get_input_embeddings().weight.detach()
    start = prompts.shape[1] - 1
    with torch.no_grad():
        trace = greedy_trace(model, prompts, PROBE_MAX_TOKENS)
        feats, labels, sample_w = draft_training_set(weights, embed, trace, start)
    return FitSamples(feats, labels, sample_w, trace.greedy[:, start:-1])


def build_draft(
    model: Any, tokenizer: PreTrainedTokenizerFast, progress: Callable[[str], None]
) -> tuple[dict, dict, list[dict], dict]:
    """Random Eagle3 draft with its lm_head refit to the target's greedy tokens
    on the probe set. Returns (config, weights, probes, fit report)."""
    import torch

    config = draft_config(len(tokenizer), _special_ids(tokenizer))
    weights = init_draft_weights(config)
    samples, probes = [], []
    for prompts in _probe_groups(tokenizer):
        progress(
            f"  probes: {len(prompts)} x {prompts.shape[1]} tokens "
            f"+ {PROBE_MAX_TOKENS} greedy"
        )
        fit = _fit_samples(model, weights, prompts)
        samples.append(fit)
        probes += [
            {"prompt": p.tolist(), "greedy": c.tolist()}
            for p, c in zip(prompts, fit.continuations, strict=True)
        ]
    feats = torch.cat([f.features for f in samples])
    labels = torch.cat([f.labels for f in samples])
    sample_w = torch.cat([f.weights for f in samples])
    progress(f"  fitting draft lm_head on {len(labels)} samples")
    head = fit_lm_head(feats, labels, sample_w, config["draft_vocab_size"])
    weights["lm_head.weight"] = head
    is_first = sample_w == 1.0
    report = {
        "samples": len(labels),
        "train_acc_pos0": _accuracy(head, feats[is_first], labels[is_first]),
        "train_acc_pos1": _accuracy(head, feats[~is_first], labels[~is_first]),
    }
    return config, weights, probes, report


def save_draft(
    config: dict[str, Any], weights: dict[str, torch.Tensor], out_dir: Path
) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    check_draft_weights({k: tuple(v.shape) for k, v in weights.items()}, config)
    tensors = {k: v.to(_torch_dtype()).contiguous() for k, v in sorted(weights.items())}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    verify_draft_checkpoint(out_dir)


def _torch_dtype() -> torch.dtype:
    import torch

    return getattr(torch, DTYPE)


def generate(out_dir: Path, progress: Callable[[str], None] = print) -> dict:
    """Write target/ and draft/ under out_dir; returns the fit report."""
    started = time.monotonic()
    with _deterministic_torch():
        progress("tiny-model: training byte-level BPE tokenizer")
        tokenizer = build_tokenizer(out_dir / "target")
        progress(f"tiny-model: building DeepSeek-V2 target (vocab {len(tokenizer)})")
        target = build_target(tokenizer)
        save_target(target, out_dir / "target")
        progress("tiny-model: building Eagle3 draft and refitting its lm_head")
        config, weights, probes, report = build_draft(target, tokenizer, progress)
        save_draft(config, weights, out_dir / "draft")
        (out_dir / "draft" / PROBE_FILE).write_text(
            json.dumps({"max_tokens": PROBE_MAX_TOKENS, "probes": probes})
        )
        tokenizer.save_pretrained(out_dir / "draft")
    report["seconds"] = round(time.monotonic() - started, 1)
    progress(
        "tiny-model: draft train accuracy "
        f"pos0={report['train_acc_pos0']:.4f} pos1={report['train_acc_pos1']:.4f} "
        f"({report['samples']} samples, {report['seconds']}s)"
    )
    return report


def _is_complete(model_dir: Path, stamp: str) -> bool:
    try:
        recorded = json.loads((model_dir / STAMP_FILE).read_text()).get("stamp")
        verify_draft_checkpoint(model_dir / "draft")
    except (OSError, ValueError, DraftCheckpointError):
        return False
    return (
        recorded == stamp
        and (model_dir / "target" / "model.safetensors").is_file()
        and (model_dir / "draft" / PROBE_FILE).is_file()
    )


def _remove_stale_temps(cache_dir: Path, prefix: str) -> None:
    """Temp dirs of killed generations; an hour old is surely not running."""
    for path in cache_dir.glob(f"{prefix}*"):
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > STALE_TEMP_S:
                shutil.rmtree(path)


def _make_readable(root: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; the cache may be
    shared with a server running as another user."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _install(tmp: Path, final: Path, stamp: str) -> None:
    """Atomically move a finished generation into place."""
    _make_readable(tmp)
    if final.exists() and not _is_complete(final, stamp):
        shutil.rmtree(final)  # a damaged copy: the stamp names only our output
    try:
        os.rename(tmp, final)
    except OSError:
        # A concurrent generator got there first; its result is identical.
        if not _is_complete(final, stamp):
            raise


def ensure_models(
    cache_dir: Path | None = None, progress: Callable[[str], None] = print
) -> TinyModels:
    """Return the model pair, generating it on first use.

    The directory name carries the generator stamp, and a generation happens in
    a temp dir renamed into place only when complete, so a killed run never
    leaves a directory that looks valid."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    stamp = generator_stamp()
    final = cache_dir / f"pd-tiny-dsv2-eagle3-{stamp[:16]}"
    models = TinyModels(target=final / "target", draft=final / "draft")
    if _is_complete(final, stamp):
        return models
    cache_dir.mkdir(parents=True, exist_ok=True)
    temp_prefix = f".{final.name}.tmp-"
    _remove_stale_temps(cache_dir, temp_prefix)
    progress(f"tiny-model: generating into {final} (1-2 minutes on 2 cores)")
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix, dir=cache_dir))
    try:
        report = generate(tmp, progress)
        (tmp / STAMP_FILE).write_text(
            json.dumps(
                {"stamp": stamp, "params": _generator_params(), "fit": report},
                indent=2,
                sort_keys=True,
                default=list,
            )
        )
        _install(tmp, final, stamp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return models


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="default: $PD_MODEL_CACHE or ~/.cache/pd-mooncake/models",
    )
    args = parser.parse_args(argv)
    models = ensure_models(args.cache_dir, progress=lambda m: print(m, file=sys.stderr))
    print(f"target={models.target}")
    print(f"draft={models.draft}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
