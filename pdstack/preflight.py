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
device's real capability. A hub profile's config.json comes from
``--target-config``/``--draft-config``, else from the excerpts shipped in
tests/data/<profile>/, else from the Hugging Face cache.

Exit status: 0 every check accepted; 1 one rejected; 3 one unknown (nothing
to ask with: no config.json, or no backend loadable here) and none rejected,
0 instead with ``--allow-unknown``; 2 bad arguments or configuration.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_mooncake import tp_pairs
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
# Config excerpts of the hub profiles' models (shapes only), shipped so the
# preflight can answer on any host: tests/data/<profile>/<file>.
EXCERPTS = Path(__file__).resolve().parent.parent / "tests" / "data"
TARGET_EXCERPT, DRAFT_EXCERPT = "config.json", "draft_config.json"


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
    # Prompt tokens one chunk of a pull carries through the KV staging
    # buffer (kv_staging_mib, on each rank; a longer prompt crosses in
    # several); None: staging off.
    chunk_tokens: int | None = None
    batch_invariant: bool | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _hub_config(name: str, allow_download: bool, option: str) -> dict[str, Any]:
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
        f"no config.json for {name} in the Hugging Face cache: pass {option} "
        "with the path of the config.json from its repository, as "
        "tests/data/<profile>/ keeps them for the shipped profiles "
        "(docs/models.md)"
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
    target = target or _hub_config(
        str(flags["model"]), allow_download, "--target-config"
    )
    spec = flags.get("speculative-config") or {}
    # Only a separate draft model (eagle, eagle3) has attention layers of its
    # own; MTP reuses the target's.
    if not spec.get("model"):
        return target, None
    draft = read(draft_config) if draft_config else None
    return target, draft or _hub_config(
        str(spec["model"]), allow_download, "--draft-config"
    )


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


def tp_pair_problem(
    prefill: Mapping[str, Any],
    decode: Mapping[str, Any],
    model_config: Path | None = None,
    draft_config: Path | None = None,
) -> str | None:
    """pd_mooncake.tp_pairs on the two roles' rendered flags: why prefill's
    tensor-parallel size cannot feed decode's (None: it can)."""
    from pd_mooncake import checksum  # needs vLLM, as the selector does

    target, draft = models(prefill, model_config, draft_config)
    gqa = [
        tp_pairs.GqaLayers(name, kv_layout.kv_heads(cfg))
        for name, cfg in (("target", target), ("draft", draft))
        if cfg is not None and not kv_layout.is_mla(cfg)
    ]

    def extra(flags: Mapping[str, Any]) -> Mapping[str, Any]:
        return (flags.get("kv-transfer-config") or {}).get(
            "kv_connector_extra_config"
        ) or {}

    return tp_pairs.refusal(
        int(prefill.get("tensor-parallel-size") or 1),
        int(decode.get("tensor-parallel-size") or 1),
        mla=kv_layout.is_mla(target),
        gqa_layers=gqa,
        kv_checksum=any(bool(extra(f).get(checksum.KEY)) for f in (prefill, decode)),
    )


def run(
    profiles: Sequence[str],
    gpus: Mapping[str, tuple[int, int]],
    roles: Sequence[str] = config.ROLES,
    overrides: Mapping[str, Any] | None = None,
    model_config: Path | None = None,
    draft_config: Path | None = None,
    role_overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Check]:
    """Every role of every profile on every GPU class, from configs/, and
    whether the two roles' tensor-parallel sizes pair (``role_overrides``:
    flags of one role, e.g. its ``tensor-parallel-size``)."""
    checks = []
    for profile in profiles:
        subs = profile_substitutions(profile)
        target_config = model_config or excerpt(profile, TARGET_EXCERPT)
        draft = draft_config or excerpt(profile, DRAFT_EXCERPT)
        rendered = {
            role: config.substituted(
                {
                    **config.vllm_flags(role, profile, "gpu"),
                    **(overrides or {}),
                    **(role_overrides or {}).get(role, {}),
                },
                subs,
            )
            for role in config.ROLES
        }
        ours = []
        for role in roles:
            for gpu, cap in gpus.items():
                c = check(profile, role, gpu, cap, rendered[role], target_config, draft)
                if target_config and target_config != model_config:
                    c.notes.append(f"config.json read from {_shown(target_config)}")
                ours.append(c)
        try:
            pair = tp_pair_problem(
                rendered["prefill"], rendered["decode"], target_config, draft
            )
        except (CannotCheckError, kv_layout.LayoutError):
            pair = None  # the checks above already say unknown, and why
        for c in ours:
            if pair is not None:
                c.status = "rejected"
                c.problems.append(pair)
        checks += ours
    return checks


def excerpt(profile: str, name: str) -> Path | None:
    """The shipped config excerpt of a profile's model, if there is one."""
    path = EXCERPTS / profile / name
    return path if path.is_file() else None


def _shown(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.parent.relative_to(EXCERPTS.parent.parent)) + "/"
    return str(path)


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
    # The legend only where a pick carries the mark.
    starred = any(cell.endswith("*") for row, _ in merged.values() for cell in row)
    legend = ["*: see the notes (a backend not asked here, or kernels not built)"]
    return "\n".join(lines + ([""] + legend * starred + notes if notes else []))


# --- the serving image ----------------------------------------------------------


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


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (pdstack.preflight_cli); its exit status."""
    from pdstack import preflight_cli

    return preflight_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
