"""The range or choices of every knob the stack renders, checked at render time.

vLLM checks most of its flags itself, but only when the server starts, and
the plugin checks ``kv_connector_extra_config`` only when the connector is
built, after the model has loaded: minutes (a cold download: hours) after a
typo. ``pdstack.config`` checks each value here as it renders the flags, and
says where the value came from (a configs/ file, an environment variable).

The ranges and choices are vLLM's own (its config classes' pydantic fields,
vLLM 0.32; tests/test_config.py compares them with the installed vLLM), the
connector's are the plugin's (``pd_mooncake.extra_config``). Flags not listed
here pass as they are: vLLM has hundreds. Nothing here imports vLLM: the
light client environment of the e2e suite renders flags too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

KeyPath = tuple[str, ...]  # a flag and the keys inside its JSON value
EXTRA = ("kv-transfer-config", "kv_connector_extra_config")


@dataclass(frozen=True)
class Rule:
    """What a value must be: its type, then a range or a set of choices."""

    kind: type
    low: float | None = None  # inclusive unless low_open
    high: float | None = None  # inclusive
    low_open: bool = False
    choices: tuple[str, ...] = ()
    # vLLM's field it follows ("CacheConfig.gpu_memory_utilization"), if any.
    vllm: str = ""

    def describe(self) -> str:
        """The rule in words (docs/configuration.md quotes it)."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        noun = {bool: "true or false", int: "an integer", float: "a number"}
        words = noun.get(self.kind, "a string")
        if self.low is not None:
            words += f" {'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            words += f"{' and' if self.low is not None else ''} <= {_num(self.high)}"
        return words

    def problem(self, value: Any) -> str | None:
        """Why ``value`` breaks the rule (None: it does not)."""
        if not self._typed(value) or (self.choices and value not in self.choices):
            return f"{value!r} is not {self.describe()}"
        below = self.low is not None and (
            value <= self.low if self.low_open else value < self.low
        )
        above = self.high is not None and value > self.high
        return f"{value!r} is not {self.describe()}" if below or above else None

    def _typed(self, value: Any) -> bool:
        if isinstance(value, bool):  # an int to Python, never a number here
            return self.kind is bool
        if self.kind is float:  # YAML's 1 is an int
            return isinstance(value, int | float) and math.isfinite(value)
        return isinstance(value, self.kind)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# vLLM 0.32's choices (typing.Literal) of the flags below.
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
CACHE_DTYPES = (
    "auto",
    "float16",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
    "nvfp4_ds_mla",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "ultraquant_4bit",
    "int4_per_token_head",
    "int8_per_token_head",
    "fp8_per_token_head",
    "nvfp4",
    "nvfp4_4over6",
)
KV_ROLES = ("kv_producer", "kv_both", "kv_consumer")

RULES: dict[KeyPath, Rule] = {
    ("gpu-memory-utilization",): Rule(
        float, 0, 1, low_open=True, vllm="CacheConfig.gpu_memory_utilization"
    ),
    ("block-size",): Rule(int, 0, low_open=True, vllm="CacheConfig.block_size"),
    ("kv-cache-memory-bytes",): Rule(int, 0, low_open=True),
    ("kv-cache-dtype",): Rule(
        str, choices=CACHE_DTYPES, vllm="CacheConfig.cache_dtype"
    ),
    ("dtype",): Rule(str, choices=MODEL_DTYPES, vllm="ModelConfig.dtype"),
    ("max-model-len",): Rule(int, -1, vllm="ModelConfig.max_model_len"),
    ("seed",): Rule(int),
    ("tensor-parallel-size",): Rule(int, 1, vllm="ParallelConfig.tensor_parallel_size"),
    ("max-num-seqs",): Rule(int, 1, vllm="SchedulerConfig.max_num_seqs"),
    ("max-num-batched-tokens",): Rule(
        int, 1, vllm="SchedulerConfig.max_num_batched_tokens"
    ),
    ("enforce-eager",): Rule(bool),
    ("enable-prefix-caching",): Rule(bool),
    ("trust-remote-code",): Rule(bool),
    ("model",): Rule(str),
    ("tokenizer",): Rule(str),
    ("served-model-name",): Rule(str),
    ("speculative-config", "method"): Rule(str),
    ("speculative-config", "model"): Rule(str),
    ("speculative-config", "num_speculative_tokens"): Rule(
        int, 0, low_open=True, vllm="SpeculativeConfig.num_speculative_tokens"
    ),
    ("kv-transfer-config", "kv_connector"): Rule(str),
    ("kv-transfer-config", "kv_role"): Rule(
        str, choices=KV_ROLES, vllm="KVTransferConfig.kv_role"
    ),
    ("kv-transfer-config", "engine_id"): Rule(str),
}
# The stack's ports (configs/ports.env), each a TCP port of its own.
PORT = Rule(int, 1, 65535)


def problems(flags: Mapping[str, Any]) -> Iterator[str]:
    """Each value of ``flags`` outside its rule, with its key; a partial
    mapping (one layer of configs/) is checked as far as it goes."""
    for path, rule in RULES.items():
        found, value = lookup(flags, path)
        if found and value is not None and (why := rule.problem(value)):
            yield f"{'.'.join(path)}: {why}"
    found, extra = lookup(flags, EXTRA)
    if found and extra is not None:
        yield from extra_problems(extra)


def problem(path: KeyPath, value: Any) -> str | None:
    """What is wrong with one value at ``path`` (an environment override)."""
    if path[:-1] == EXTRA:
        return next(extra_problems({path[-1]: value}), None)
    rule = RULES.get(path)
    why = rule.problem(value) if rule else None
    return f"{'.'.join(path)}: {why}" if why else None


def extra_problems(extra: Any) -> Iterator[str]:
    """The plugin's own check of kv_connector_extra_config (its messages
    name the key)."""
    from pd_mooncake import extra_config  # pure Python, no vLLM

    if not isinstance(extra, Mapping):
        yield f"{'.'.join(EXTRA)}: {extra!r} is not a mapping"
        return
    try:
        # None removes a key when configs/ layers merge (pdstack.config.merge).
        extra_config.validate({k: v for k, v in extra.items() if v is not None})
    except extra_config.ExtraConfigError as exc:
        yield str(exc)


def lookup(flags: Mapping[str, Any], path: KeyPath) -> tuple[bool, Any]:
    node: Any = flags
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return False, None
        node = node[key]
    return True, node
