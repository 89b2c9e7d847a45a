"""Bring your own model: write a profile from its config.json files.

    python -m pdstack.profile new NAME --target-config PATH [--draft-config PATH]
        [--draft-method eagle3|mtp] [--model ORG/NAME] [--draft-model ORG/NAME]
        [--gpu "H100 80GB"] [--max-model-len N] [--weights-gib X] [--rdma]
    python -m pdstack.profile show NAME [--gpu H200]
    python -m pdstack.profile overlay NAME [--rdma]

``new`` reads the target's (and an Eagle3 draft's) config.json, says which
GPUs and how many per role the model needs (pdstack.sizing), writes
configs/profiles/NAME.yaml, the shape excerpts under tests/data/NAME/ (what
the preflight and the tests read from then on) and k8s/overlays/NAME/, then
runs the GPU preflight on them. ``show`` says the same of an existing
profile; ``overlay`` writes the Kubernetes overlay of one written by hand.
docs/models.md walks through it; the images bake configs/ in, so a new
profile needs `docker compose build` (or `up --build`) before it runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdstack import config, kv_layout, overlay, preflight, sizing

DATA = preflight.EXCERPTS
# Draft methods: eagle3 (a separate draft model, GQA KV of its own) or the
# target's own MTP layers (vLLM's "mtp"; "deepseek_mtp" is its old name).
METHODS = {"eagle3": "eagle3", "mtp": "mtp", "deepseek_mtp": "mtp"}
SPECULATIVE_TOKENS = {"eagle3": 3, "mtp": 1}
DEFAULT_MAX_MODEL_LEN = 32768
NAME = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?")
# What an excerpt keeps of a config.json: the shapes and types the preflight,
# the e2e suite's layout and pdstack.sizing read (no weights' names, no code).
SHAPE_KEYS = (
    "architectures",
    "model_type",
    "torch_dtype",
    "dtype",
    "vocab_size",
    "draft_vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_topk",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "num_nextn_predict_layers",
    "max_position_embeddings",
    "tie_word_embeddings",
    "quantization_config",
    "text_config",
)


class ProfileError(ValueError):
    pass


def excerpt(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The shape keys of a config.json (text_config's too), and its source."""
    out: dict[str, Any] = {"_excerpt_of": source}
    for key in SHAPE_KEYS:
        if key in cfg:
            value = cfg[key]
            out[key] = excerpt(value, source) if key == "text_config" else value
    if "text_config" in out:
        out["text_config"].pop("_excerpt_of")
    return out


def hub_id(path: Path) -> str | None:
    """ORG/NAME of a config.json inside a Hugging Face cache
    (.../models--ORG--NAME/snapshots/<sha>/config.json)."""
    for part in Path(path).resolve().parts:
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/", 1)
    return None


def draft_method(given: str | None, draft_config: Path | None) -> str:
    if given:
        return METHODS[given]
    return "eagle3" if draft_config else "mtp"


def plan(opts: argparse.Namespace) -> dict[str, Any]:
    """Everything ``new`` writes, decided from the configs and the options."""
    target_path = Path(opts.target_config)
    target = kv_layout.read_config(target_path)
    text = kv_layout.text_config(target)
    method = draft_method(opts.draft_method, opts.draft_config)
    model = opts.model or hub_id(target_path)
    if not model:
        raise ProfileError(
            "--model ORG/NAME: the Hugging Face repository of the target "
            f"({target_path} is not inside a Hugging Face cache)"
        )
    draft, draft_model = None, None
    if method == "eagle3":
        if not opts.draft_config:
            raise ProfileError("eagle3 needs --draft-config (the draft's config.json)")
        draft = kv_layout.read_config(Path(opts.draft_config))
        draft_model = opts.draft_model or hub_id(Path(opts.draft_config))
        if not draft_model:
            raise ProfileError("--draft-model ORG/NAME: the draft's repository")
    elif not text.get("num_nextn_predict_layers"):
        raise ProfileError(
            f"{target_path}: no MTP layers (num_nextn_predict_layers): give an "
            "Eagle3 draft with --draft-config and --draft-model"
        )
    try:
        weights = sizing.weights(target_path, target, method == "mtp", opts.weights_gib)
        if draft is not None and not opts.weights_gib:
            weights = sizing.with_draft(weights, draft)
    except KeyError as exc:
        raise ProfileError(
            f"{target_path} lacks {exc} to count the weights: pass --weights-gib, "
            "or put the checkpoint's model.safetensors.index.json beside it"
        ) from exc
    max_len = opts.max_model_len or min(
        int(text.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN),
        DEFAULT_MAX_MODEL_LEN,
    )
    per_token = kv_layout.layout(target, draft, "bfloat16", 1, 1).bytes_per_block()
    heads = int(text["num_attention_heads"])
    fits = sizing.fits(weights.bytes, per_token, max_len, heads)
    chosen = next(f for f in fits if f.gpu == opts.gpu)
    width = opts.tensor_parallel_size or chosen.width
    short = chosen.width is None or (width or 0) < chosen.width
    if width is None or width > sizing.HOST_GPUS:
        raise ProfileError(
            f"{model} needs {chosen.width or 'more than 16'} {opts.gpu} GPUs per "
            "role: more than one host per role, which this stack's compose and "
            "manifests do not run (docs/models.md, 'More than one host per role'). "
            f"Other GPU classes: {'; '.join(map(sizing.describe, fits))}"
        )
    return dict(
        target=target,
        draft=draft,
        method=method,
        model=model,
        draft_model=draft_model,
        weights=weights,
        max_model_len=max_len,
        fits=fits,
        width=width,
        budget=sizing.start_budget_s(weights.bytes),
        short=short,
        remote_code=bool(target.get("auto_map")),
    )


def profile_yaml(name: str, p: Mapping[str, Any], gpu: str) -> str:
    """The profile, with comments that say where each value came from."""
    text = kv_layout.text_config(p["target"])
    kind = "MLA" if kv_layout.is_mla(text) else "GQA"
    layers = text.get("num_nextn_predict_layers")
    draft = (
        f"the Eagle3 draft {p['draft_model']}"
        if p["method"] == "eagle3"
        else f"its own MTP layers ({layers})"
    )
    spec: dict[str, Any] = {"method": p["method"]}
    if p["draft_model"]:
        spec["model"] = p["draft_model"]
    spec["num_speculative_tokens"] = SPECULATIVE_TOKENS[p["method"]]
    vllm: dict[str, Any] = {"model": p["model"]}
    if p["remote_code"]:
        vllm["trust-remote-code"] = True
    vllm |= {
        "tensor-parallel-size": p["width"],
        "max-model-len": p["max_model_len"],
        "speculative-config": spec,
    }
    weights = p["weights"]
    header = (
        f"Profile {name}: {p['model']} ({text.get('model_type')}, {kind}) with "
        f"{draft}. Written by `python -m pdstack.profile new` on "
        f"{datetime.date.today()} (docs/models.md). Weights "
        f"{weights.bytes / sizing.GIB:.1f} GiB ({weights.source}): {p['width']} x "
        f"{gpu} per role (pdstack.sizing)."
    )
    lines = [f"# {line}" for line in textwrap.wrap(header, 76)]
    lines += [
        f"gpus_per_role: {p['width']}",
        "# A cold start: download, load, compile (pdstack.sizing.start_budget_s);",
        "# compose: PD_START_PERIOD in .env; Kubernetes: the overlay's startupProbe.",
        f"start_period: {sizing.duration(p['budget'])}",
        "vllm:",
    ]
    if p["remote_code"]:
        lines.append("  # config.json names code of its own (auto_map).")
    body = json.loads(json.dumps(vllm))  # plain types for the YAML writer
    lines += [f"  {line}" for line in _yaml_lines(body)]
    return "\n".join(lines) + "\n"


def _yaml_lines(data: Mapping[str, Any]) -> list[str]:
    import yaml

    return yaml.safe_dump(data, sort_keys=False).splitlines()


def new(opts: argparse.Namespace) -> int:
    name = opts.name
    path = config.CONFIGS / "profiles" / f"{name}.yaml"
    if not NAME.fullmatch(name):
        raise ProfileError(f"{name!r}: lowercase letters, digits, '.' and '-' only")
    if path.exists() and not opts.force:
        raise ProfileError(f"{path} exists (--force rewrites it)")
    p = plan(opts)
    path.write_text(profile_yaml(name, p, opts.gpu))
    data = DATA / name
    data.mkdir(parents=True, exist_ok=True)
    source = f"https://huggingface.co/{p['model']}/blob/main/config.json"
    written = [path, data / preflight.TARGET_EXCERPT]
    (data / preflight.TARGET_EXCERPT).write_text(
        json.dumps(excerpt(p["target"], source), indent=2) + "\n"
    )
    if p["draft"] is not None:
        draft_source = (
            f"https://huggingface.co/{p['draft_model']}/blob/main/config.json"
        )
        (data / preflight.DRAFT_EXCERPT).write_text(
            json.dumps(excerpt(p["draft"], draft_source), indent=2) + "\n"
        )
        written.append(data / preflight.DRAFT_EXCERPT)
    summary = f"{p['model']}, {p['width']} GPU(s) per role"
    written += overlay.write(
        name, p["width"], p["budget"], p["weights"].bytes, opts.rdma, summary
    )
    for file in written:
        print(f"wrote {file.relative_to(overlay.ROOT)}")
    return report(name, p, opts.gpu)


def report(name: str, p: Mapping[str, Any], gpu: str) -> int:
    """What it needs, the preflight's answer, what to run next."""
    weights = p["weights"]
    print(f"\n{name}: weights {weights.bytes / sizing.GIB:.1f} GiB ({weights.source})")
    print(f"GPUs per role (max-model-len {p['max_model_len']}, pdstack.sizing):")
    for fit in p["fits"]:
        print(f"  {sizing.describe(fit)}")
    if p["short"]:
        print(
            f"  warning: tensor-parallel-size {p['width']} is fewer GPUs than "
            f"{gpu} needs by this estimate"
        )
    from pdstack import preflight_cli

    with preflight_cli.vllm_quiet(verbose=False):
        gpus = {g: cap for g, (cap, _) in preflight.GPUS.items()}
        checks = preflight.run([name], gpus)
    print(f"\nGPU preflight ({preflight_cli.parser().prog} --profile {name}):")
    print(preflight.table(checks))
    width, both = p["width"], 2 * p["width"]
    ids = [",".join(map(str, range(a, a + width))) for a in (0, width)]
    shapes = f"--target-config tests/data/{name}/{preflight.TARGET_EXCERPT}"
    if p["draft"] is not None:
        shapes += f" --draft-config tests/data/{name}/{preflight.DRAFT_EXCERPT}"
    compose = (
        f"  compose, on one host with {both} GPUs:\n"
        f"    .env: PD_PROFILE={name}  PREFILL_GPUS={ids[0]}  DECODE_GPUS={ids[1]}"
        f"  PD_START_PERIOD={sizing.duration(p['budget'])}\n"
        "    docker compose build    # configs/ is baked into the images\n"
        f'    make up-e2e && make e2e PYTEST_ARGS="{shapes}"\n'
    )
    if both > sizing.HOST_GPUS:
        compose = (
            f"  compose runs both roles on one host: it needs {both} GPUs there;\n"
            "  with 8-GPU hosts, Kubernetes puts each role on a node of its own:\n"
        )
    print(
        f"\nNext (docs/models.md): {width} {gpu} GPU(s) per role, {both} in all.\n"
        f"{compose}  kubectl -n pd apply -k k8s/overlays/{name}"
    )
    return preflight_cli.exit_status(checks, allow_unknown=False)


def show(opts: argparse.Namespace) -> int:
    """``new``'s report for an existing profile, from its excerpts."""
    name = opts.name
    chosen = config.profile(name)
    flags = chosen.get("vllm") or {}
    target_path = preflight.excerpt(name, preflight.TARGET_EXCERPT)
    if target_path is None:
        raise ProfileError(f"no excerpt tests/data/{name}/config.json to size from")
    spec = flags.get("speculative-config") or {}
    args = argparse.Namespace(
        target_config=target_path,
        draft_config=preflight.excerpt(name, preflight.DRAFT_EXCERPT),
        draft_method=spec.get("method"),
        model=flags.get("model"),
        draft_model=spec.get("model"),
        weights_gib=opts.weights_gib,
        max_model_len=flags.get("max-model-len"),
        tensor_parallel_size=flags.get("tensor-parallel-size"),
        gpu=opts.gpu,
    )
    planned = plan(args)
    if start := chosen.get("start_period"):
        planned["budget"] = _seconds(str(start))  # the profile's own figure
    return report(name, planned, opts.gpu)


def write_overlay(opts: argparse.Namespace) -> int:
    """k8s/overlays/NAME/ for an existing profile (one written by hand)."""
    name = opts.name
    chosen = config.profile(name)
    flags = chosen.get("vllm") or {}
    gpus = int(chosen.get("gpus_per_role") or flags.get("tensor-parallel-size") or 1)
    start = chosen.get("start_period")
    budget = _seconds(str(start)) if start else overlay.BASE_BUDGET_S
    weight_bytes = int((opts.weights_gib or 0) * sizing.GIB)
    summary = f"{flags.get('model', name)}, {gpus} GPU(s) per role"
    for file in overlay.write(name, gpus, budget, weight_bytes, opts.rdma, summary):
        print(f"wrote {file.relative_to(overlay.ROOT)}")
    return 0


def _seconds(duration: str) -> int:
    """2h30m, 45m, 90s -> seconds."""
    parts = re.findall(r"(\d+)([hms])", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ProfileError(f"start_period {duration!r}: expected e.g. 2h30m or 45m")
    return sum(int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdstack.profile", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("new", help="write a profile from config.json files")
    make.add_argument("name", help="the profile's name (PD_PROFILE)")
    make.add_argument("--target-config", type=Path, required=True, metavar="PATH")
    make.add_argument("--draft-config", type=Path, metavar="PATH")
    make.add_argument("--draft-method", choices=sorted(METHODS))
    make.add_argument("--model", help="the target's Hugging Face repository")
    make.add_argument("--draft-model", help="the Eagle3 draft's repository")
    make.add_argument("--max-model-len", type=int)
    make.add_argument("--tensor-parallel-size", type=int, help="default: sized")
    make.add_argument("--rdma", action="store_true", help="Mooncake over RDMA (k8s)")
    make.add_argument("--force", action="store_true", help="rewrite a profile")
    shown = sub.add_parser("show", help="what an existing profile needs")
    shown.add_argument("name")
    for each in (make, shown):
        each.add_argument("--gpu", choices=list(sizing.GPUS), default="H100 80GB")
    written = sub.add_parser("overlay", help="k8s/overlays/NAME of a profile")
    written.add_argument("name")
    written.add_argument("--rdma", action="store_true", help="Mooncake over RDMA")
    for each in (make, shown, written):
        each.add_argument("--weights-gib", type=float, help="the weights' size")
    opts = parser.parse_args(argv)
    commands = {"new": new, "show": show, "overlay": write_overlay}
    try:
        return commands[opts.command](opts)
    except (ProfileError, config.ConfigError, kv_layout.LayoutError) as exc:
        print(f"pdstack.profile: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
