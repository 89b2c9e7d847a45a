"""Everything that determines the generated files, and the stamp hashing it.

Every upper-case constant here goes into the generator stamp (see
generator_params), which names the cache directory: changing one regenerates
the models, and a constant that does not change the files belongs elsewhere.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

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

# --- draft refit data (see the package docstring) -----------------------------
# (prompt length in tokens incl. BOS, number of prompts); English/random alternate
PROBE_GROUPS = ((16, 8), (32, 8), (48, 8), (64, 8), (128, 4), (256, 2), (1024, 2))
PROBE_MAX_TOKENS = 64  # continuation fitted per probe; longer outputs fall off
PROBE_FILE = "probe_prompts.json"
FIT_RIDGE = 1e-2
FIT_CE_STEPS = 200
FIT_CE_LR = 0.05
FIT_STEP2_WEIGHT = 0.5  # lm_head is shared by both draft positions


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


def generator_params() -> dict[str, Any]:
    """The constants above, the corpus by its hash."""
    names = sorted(
        name
        for name, value in globals().items()
        if name.isupper()
        and isinstance(value, (int, float, str, tuple, dict))
        and name != "CORPUS"
    )
    params = {name: globals()[name] for name in names}
    params["CORPUS_SHA256"] = hashlib.sha256(CORPUS.encode()).hexdigest()
    return params


def generator_stamp() -> str:
    """Stable hash of the generator's parameters; names the cache directory."""
    blob = json.dumps(generator_params(), sort_keys=True, default=list)
    return hashlib.sha256(blob.encode()).hexdigest()
