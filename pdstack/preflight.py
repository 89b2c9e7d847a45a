"""GPU preflight: would vLLM's CUDA attention selector take this stack's flags?

    python -m pdstack.preflight [--profile P ...] [--capability sm90 ...] [--json]
    python -m pdstack.preflight --profile tiny --capability sm90 --print batch-invariant

For each role of each profile: vLLM's own CUDA selector
(``pdstack.cuda_selector``) on A100 (sm80), H100/H200 (sm90) and B200 (sm100)
for the target's and the Eagle draft's attention layers, the block size and
the Mooncake connector's kernel block size that result, and the bytes of each
registered region (``pdstack.kv_layout``). On a host without CUDA kernels a
backend that cannot be loaded is unknown, never a rejection; configuration
reasons (dtype, head size, block size, ...) fail it, naming the key to change.
``pdstack.serve`` runs it before vLLM starts in the serving image, with the
device's real capability. Exit status: 0 accepted or unknown, 1 rejected.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdstack import config, cuda_selector, kv_layout, staging_room
from pdstack.cuda_selector import Layer

# The GPU classes checked by default: name -> (capability, what it is).
GPUS: dict[str, tuple[tuple[int, int], str]] = {
    "sm80": ((8, 0), "A100"),
    "sm90": ((9, 0), "H100/H200"),
    "sm100": ((10, 0), "B200"),
}
# Configuration reasons -> what to change. A flag names its configs/ key.
FIXES = {
    "dtype not supported": "`dtype`",
    "block_size not supported": "`block-size`",
    "kv_cache_dtype not supported": "`kv-cache-dtype`",
    "head_size not supported": "the model (its head size is in config.json)",
    "compute capability not supported": "the GPU class",
}
# Values tried for a flag a rejection names, to say which vLLM would take:
# flag -> (its AttentionSelectorConfig field, values; None: unset).
ALTERNATIVES: dict[str, tuple[str, tuple[Any, ...]]] = {
    "`dtype`": ("dtype", ("bfloat16", "float16")),
    "`block-size`": ("block_size", (None, 16, 64, 128)),
    "`kv-cache-dtype`": ("kv_cache_dtype", ("auto",)),
}
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


class CannotCheckError(Exception):
    """The check cannot be made here (no config.json, no device)."""


@dataclass
class Check:
    profile: str
    role: str
    gpu: str
    capability: str
    status: str  # accepted, rejected, unknown
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    layers: list[Layer] = field(default_factory=list)
    block_size: int | None = None
    kernel_block_size: int | None = None
    # Per registered region: layout, layers, bytes per kernel block of one
    # layer on one rank (what the plugin logs at start-up).
    regions: list[dict[str, Any]] = field(default_factory=list)
    bytes_per_token: int | None = None  # every layer, every rank
    # The longest prompt one pull can send through the KV staging buffer
    # (kv_staging_mib, on each rank); None: staging off.
    staged_tokens: int | None = None
    batch_invariant: bool | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _hub_config(name: str, allow_download: bool) -> dict[str, Any]:
    """config.json of a local directory or a Hugging Face repo (cache first)."""
    if Path(name).exists():
        return kv_layout.read_config(Path(name))
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        # The cache of HF_HOME / HF_HUB_CACHE, as vLLM would read it.
        cached = try_to_load_from_cache(name, "config.json")
        if isinstance(cached, str):
            return kv_layout.read_config(Path(cached))
        if allow_download:
            # Only in the serving image, where vLLM downloads it seconds later.
            return kv_layout.read_config(Path(hf_hub_download(name, "config.json")))
    except Exception as exc:  # an invalid repo id, no network, no token
        raise CannotCheckError(f"no config.json for {name}: {exc}") from exc
    raise CannotCheckError(
        f"no config.json for {name} in the Hugging Face cache "
        "(pass --model-config PATH and --draft-config PATH)"
    )


def models(
    flags: Mapping[str, Any],
    model_config: Path | None = None,
    draft_config: Path | None = None,
    allow_download: bool = False,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The target's and the Eagle draft's config.json (flags already rendered)."""
    read = kv_layout.read_config
    target = read(model_config) if model_config else None
    target = target or _hub_config(str(flags["model"]), allow_download)
    spec = flags.get("speculative-config") or {}
    # Only a separate draft model (eagle, eagle3) has attention layers of its
    # own; MTP reuses the target's.
    if not spec.get("model"):
        return target, None
    draft = read(draft_config) if draft_config else None
    return target, draft or _hub_config(str(spec["model"]), allow_download)


def profile_substitutions(profile: str) -> dict[str, str]:
    return config.tiny_substitutions(profile, lambda line: print(line, file=sys.stderr))


def check(
    profile: str,
    role: str,
    gpu: str,
    capability: tuple[int, int],
    flags: Mapping[str, Any],
    model_config: Path | None = None,
    draft_config: Path | None = None,
    allow_download: bool = False,
) -> Check:
    """One role on one GPU class; ``flags``: its rendered vLLM flags."""
    result = Check(profile, role, gpu, f"{capability[0]}.{capability[1]}", "unknown")
    try:
        target, draft = models(flags, model_config, draft_config, allow_download)
    except (CannotCheckError, kv_layout.LayoutError) as exc:
        result.notes.append(f"unknown: {exc}")
        return result
    v = cuda_selector.vllm()
    result.dtype = cuda_selector.run_dtype(
        str(flags.get("dtype", "auto")),
        {**target, **kv_layout.text_config(target)},
        capability,
    )
    result.kv_cache_dtype = str(flags.get("kv-cache-dtype", "auto"))
    where = f"configs/profiles/{profile}.yaml (targets.gpu)"
    if v.torch_dtype(result.dtype) is None:
        result.status = "rejected"
        result.problems.append(
            f"dtype {result.dtype!r} is not a vLLM dtype: change `dtype` in {where}"
        )
        return result
    tp = int(flags.get("tensor-parallel-size", 1))
    block_flag = int(flags["block-size"]) if flags.get("block-size") else None
    classes: list[Any] = []
    for name, cfg in (("target", target), ("draft", draft)):
        if cfg is None:
            continue
        text = kv_layout.text_config(cfg)
        mla = kv_layout.is_mla(text)
        # What vLLM's attention layers pass its selector (per tensor-parallel
        # rank); models with an indexer (index_topk) run sparse MLA.
        head = kv_layout.mla_head_size(text) if mla else kv_layout.head_dim(text)
        sel = v.selector_config(
            head_size=head,
            dtype=v.torch_dtype(result.dtype),
            kv_cache_dtype=result.kv_cache_dtype,
            block_size=block_flag,
            use_mla=mla,
            use_sparse=bool(text.get("index_topk")),
            use_kv_connector=bool(flags.get("kv-transfer-config")),
        )
        heads = max(1, int(text["num_attention_heads"]) // tp)
        layer, loaded = cuda_selector.select(capability, sel, heads)
        layer.model, layer.kind = name, "MLA" if mla else "GQA"
        # What VLLM_BATCH_INVARIANT=1 would make of the same layer.
        invariant = sel._replace(use_batch_invariant=True)
        layer.batch_invariant_pick = cuda_selector.pick(capability, invariant, heads)
        result.layers.append(layer)
        # Distinct backends, in layer order, as the engine collects them.
        classes += [c for c in loaded.values() if c not in classes]
        _explain(result, layer, where, capability, sel)
    if any(layer.status == "rejected" for layer in result.layers):
        result.status = "rejected"
        return result
    if not all(layer.pick for layer in result.layers):
        return result  # unknown: _explain said which layer
    result.batch_invariant = all(la.batch_invariant_pick for la in result.layers)
    try:
        block, kernel = cuda_selector.block_sizes(classes, block_flag)
    except ValueError as exc:
        result.status = "rejected"
        result.problems.append(f"{exc} Change `block-size` in {where}.")
        return result
    result.status = "accepted"
    result.block_size, result.kernel_block_size = block, kernel
    kv = result.dtype if result.kv_cache_dtype == "auto" else result.kv_cache_dtype
    lay = kv_layout.layout(target, draft, kv, kernel, tp)
    result.regions = [
        dict(
            model=r.model,
            layout=r.layout,
            layers=r.layers,
            bytes_per_block=r.bytes_per_token // tp * kernel,
        )
        for r in lay.regions
    ]
    result.bytes_per_token = lay.bytes_per_block() // kernel
    staging_room.check(result, flags, kernel)
    return result


def _explain(
    result: Check, layer: Layer, where: str, capability: tuple[int, int], sel: Any
) -> None:
    """Notes on what could not be asked here; for a rejection, the problem
    with the key to change and the values vLLM would take instead."""
    what = (
        f"{layer.model} {layer.kind} layers (head size {layer.head_size}, "
        f"{result.dtype}, {layer.num_heads} heads/rank)"
    )
    skipped = ", ".join(layer.not_asked_before)
    if layer.pick and skipped:
        result.notes.append(
            f"{what}: vLLM picks {skipped} instead of {layer.pick} "
            "if its kernels accept (not loadable on this host)"
        )
    if layer.pick_unbuilt:
        result.notes.append(
            f"{what}: {layer.pick} validated; its kernels are not built on this host"
        )
    if layer.status == "unknown":
        result.notes.append(f"{what}: unknown, no backend loadable here ({skipped})")
    if layer.status != "rejected":
        return
    cap = f"{capability[0]}{capability[1]}"
    asked = {
        n: [r for r in rs if not cuda_selector.is_availability(r)]
        for n, rs in layer.reasons.items()
        if n not in layer.not_asked_before
    }
    # The backends a change of configuration would win: every reason has a
    # fix; those needing the fewest changes name the keys.
    keyed = {
        n: {FIXES[r] for r in rs}
        for n, rs in asked.items()
        if rs and all(r in FIXES for r in rs)
    }
    fewest = min(map(len, keyed.values()), default=0)
    near = [n for n, k in keyed.items() if len(k) == fewest] or list(asked)
    keys = sorted({k for n in near for k in keyed.get(n, ())})
    message = f"{what}: no CUDA attention backend takes them on sm{cap}: " + "; ".join(
        f"{n}: {', '.join(asked[n])}" for n in near
    )
    if len(near) < len(asked):
        message += f" ({len(asked) - len(near)} more for other kinds of layer or GPU)"
    if skipped:
        message += f"; not loadable here: {skipped}"
    if keys:
        message += f". Change {' or '.join(keys)}"
        message += f" in {where}" if any(k.startswith("`") for k in keys) else ""
    fixes = [
        f"{key.strip('`')} {'unset' if value is None else value} ({pick})"
        for key in keys
        if key in ALTERNATIVES
        for value, pick in cuda_selector.accepted_values(
            capability, sel, layer.num_heads, *ALTERNATIVES[key]
        )
    ]
    result.problems.append(
        message + (f"; accepted: {', '.join(fixes)}." * bool(fixes) or ".")
    )


def run(
    profiles: Sequence[str],
    gpus: Mapping[str, tuple[int, int]],
    roles: Sequence[str] = config.ROLES,
    overrides: Mapping[str, Any] | None = None,
    model_config: Path | None = None,
    draft_config: Path | None = None,
) -> list[Check]:
    """Every role of every profile on every GPU class, from configs/."""
    checks = []
    for profile in profiles:
        subs = profile_substitutions(profile)
        for role in roles:
            flags = {**config.vllm_flags(role, profile, "gpu"), **(overrides or {})}
            rendered = config.substituted(flags, subs)
            checks += [
                check(profile, role, gpu, cap, rendered, model_config, draft_config)
                for gpu, cap in gpus.items()
            ]
    return checks


# --- output ---------------------------------------------------------------------

HEADER = "profile roles GPU target draft block/kernel bytes/block/layer B/token"
HEADER += " batch-inv result"


def _row(c: Check) -> list[str]:
    dtype = SHORT_DTYPE.get(c.dtype or "", c.dtype)
    cells = [
        f"{la.kind} {la.head_size} {dtype}: {la.pick or la.status}"
        + ("*" if la.pick and (la.pick_unbuilt or la.not_asked_before) else "")
        for la in c.layers
    ] + ["-", "-"]
    blocks = f"{c.block_size}/{c.kernel_block_size}" if c.block_size else "-"
    regions = ", ".join(
        f"{r['layout']} {r['layers']}x{r['bytes_per_block']}" for r in c.regions
    )
    return [
        c.profile,
        c.role,
        f"{c.gpu} {GPUS[c.gpu][1]}" if c.gpu in GPUS else c.gpu,
        *cells[:2],
        blocks,
        regions or "-",
        str(c.bytes_per_token or "-"),
        {True: "yes", False: "no", None: "-"}[c.batch_invariant],
        c.status,
    ]


def table(checks: Sequence[Check]) -> str:
    """One row per profile and GPU (roles merged where they agree), then the
    problems and notes (a * marks a pick with notes)."""
    merged: dict[str, tuple[list[str], list[str]]] = {}
    for c in checks:
        row = _row(c)
        key = json.dumps([row[:1] + row[2:], c.problems, c.notes])
        if key in merged:
            merged[key][0][1] += f", {c.role}"
        else:
            merged[key] = (row, [*c.problems, *c.notes])
    rows = [HEADER.split(), *(row for row, _ in merged.values())]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in rows
    ]
    notes = [
        f"- {r[0]} {r[1]} {r[2].split()[0]}: {n}"
        for r, ns in merged.values()
        for n in ns
    ]
    legend = "*: see the notes (a backend not asked here, or kernels not built)"
    return "\n".join(lines + (["", legend, *notes] if notes else []))


# --- the serving image and the CLI ---------------------------------------------


def device_gpus() -> dict[str, tuple[int, int]]:
    """The capabilities of the visible CUDA devices (none without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    caps = {
        torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())
    }
    return {f"sm{major}{minor}": (major, minor) for major, minor in sorted(caps)}


def gate(profile: str, role: str, flags: Mapping[str, Any]) -> list[str]:
    """pdstack.serve's check before exec'ing vLLM: the problems (none: go on)."""
    if not (gpus := device_gpus()):
        print("pdstack.preflight: no CUDA device visible; skipped", file=sys.stderr)
        return []
    checks = [
        check(profile, role, gpu, cap, flags, allow_download=True)
        for gpu, cap in gpus.items()
    ]
    print(table(checks), file=sys.stderr, flush=True)
    return [p for c in checks for p in c.problems]


def parse_gpu(text: str) -> tuple[str, tuple[int, int]]:
    """sm90, 9.0 or 90 -> ("sm90", (9, 0))."""
    raw = text.lower().removeprefix("sm").replace(".", "")
    if not raw.isdigit() or len(raw) < 2:
        raise argparse.ArgumentTypeError(f"not a compute capability: {text!r}")
    return f"sm{raw}", (int(raw[:-1]), int(raw[-1]))


def parse_set(text: str) -> tuple[str, Any]:
    """FLAG=VALUE, the value as YAML would read it (configs/ are YAML)."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected FLAG=VALUE, got {text!r}")
    return key, yaml.safe_load(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdstack.preflight", description=__doc__.splitlines()[0]
    )
    known = config.profile_names()
    add = parser.add_argument
    add("--profile", action="append", choices=known, help="default: every profile")
    add("--role", action="append", choices=config.ROLES, help="default: both")
    add(
        "--capability",
        action="append",
        type=parse_gpu,
        help="sm80, 9.0 or 100, repeatable; default: sm80 sm90 sm100",
    )
    add("--device", action="store_true", help="the visible CUDA devices' instead")
    add("--model-config", type=Path, help="the target's config.json (hub profiles)")
    add("--draft-config", type=Path, help="the draft's config.json (hub profiles)")
    add(
        "--set",
        action="append",
        type=parse_set,
        default=[],
        metavar="FLAG=VALUE",
        help="override a vLLM flag of configs/ (what-if)",
    )
    add("--json", action="store_true", help="JSON instead of the table")
    add(
        "--print",
        choices=["batch-invariant"],
        help="print 1 if every layer keeps a backend under VLLM_BATCH_INVARIANT=1, "
        "else 0 (needs one capability)",
    )
    opts = parser.parse_args(argv)
    gpus = dict(opts.capability or [(g, c) for g, (c, _) in GPUS.items()])
    if opts.device and not (gpus := device_gpus()):
        parser.exit(2, "pdstack.preflight: --device: no CUDA device visible\n")
    if opts.print and len(gpus) != 1:
        parser.error("--print batch-invariant needs exactly one capability")
    try:
        checks = run(
            opts.profile or known,
            gpus,
            opts.role or config.ROLES,
            dict(opts.set),
            opts.model_config,
            opts.draft_config,
        )
    except config.ConfigError as exc:
        parser.exit(2, f"pdstack.preflight: {exc}\n")
    rejected = any(c.status == "rejected" for c in checks)
    if opts.print:
        print(int(all(c.batch_invariant for c in checks)))
        for problem in (p for c in checks for p in c.problems):
            print(f"pdstack.preflight: {problem}", file=sys.stderr)
    elif opts.json:
        state = {"ok": not rejected, "checks": [asdict(c) for c in checks]}
        print(json.dumps(state, indent=2))
    else:
        print(table(checks))
    return int(rejected)


if __name__ == "__main__":
    sys.exit(main())
