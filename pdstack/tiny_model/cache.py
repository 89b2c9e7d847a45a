"""The model cache: generate the pair once into a stamped directory, atomically,
and find it again afterwards."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pdstack.tiny_model import params
from pdstack.tiny_model.draft import (
    DraftCheckpointError,
    draft_config,
    save_draft,
    verify_draft_checkpoint,
)
from pdstack.tiny_model.fit import build_draft
from pdstack.tiny_model.target import build_target, config_fields, save_target
from pdstack.tiny_model.tokenizer import build_tokenizer

STAMP_FILE = "pd-tiny-stamp.json"
STALE_TEMP_S = 3600.0


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


def layout_configs() -> tuple[dict[str, Any], dict[str, Any]]:
    """The pair's config.json (target, draft) as pdstack.kv_layout reads them,
    without generating the pair: no torch, so a client venv judges a stack of
    the tiny profile. Only the tokenizer's fields differ from the files (the
    vocabulary does not shape the KV cache): its nominal size, no special ids."""
    return (
        config_fields(),
        draft_config(params.TOKENIZER_VOCAB_SIZE, {}),
    )


def load_probes(models: TinyModels) -> list[Probe]:
    """The probe set saved next to the draft (see params.PROBE_GROUPS)."""
    data = json.loads((models.draft / params.PROBE_FILE).read_text())
    return [Probe(p["prompt"], p["greedy"]) for p in data["probes"]]


@contextlib.contextmanager
def deterministic_torch() -> Iterator[None]:
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


def generate(out_dir: Path, progress: Callable[[str], None] = print) -> dict:
    """Write target/ and draft/ under out_dir; returns the fit report."""
    started = time.monotonic()
    with deterministic_torch():
        progress("tiny-model: training byte-level BPE tokenizer")
        tokenizer = build_tokenizer(out_dir / "target")
        progress(f"tiny-model: building DeepSeek-V2 target (vocab {len(tokenizer)})")
        target = build_target(tokenizer)
        save_target(target, out_dir / "target")
        progress("tiny-model: building Eagle3 draft and refitting its lm_head")
        config, weights, probes, report = build_draft(target, tokenizer, progress)
        save_draft(config, weights, out_dir / "draft")
        (out_dir / "draft" / params.PROBE_FILE).write_text(
            json.dumps({"max_tokens": params.PROBE_MAX_TOKENS, "probes": probes})
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
        and (model_dir / "draft" / params.PROBE_FILE).is_file()
    )


def _install(tmp: Path, final: Path, stamp: str) -> None:
    """Atomically move a finished generation into place."""
    # mkdtemp and safetensors create owner-only entries; the cache may be
    # shared with a server running as another user.
    tmp.chmod(0o755)
    for path in tmp.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    if final.exists() and not _is_complete(final, stamp):
        shutil.rmtree(final)  # a damaged copy: the stamp names only our output
    try:
        os.rename(tmp, final)
    except OSError:
        # A concurrent generator got there first; its result is identical.
        if not _is_complete(final, stamp):
            raise


def _cache_dir(cache_dir: Path | None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get("PD_MODEL_CACHE") or "~/.cache/pd-mooncake/models"
    return Path(cache_dir).expanduser()


def _final(cache_dir: Path, stamp: str) -> Path:
    return cache_dir / f"pd-tiny-dsv2-eagle3-{stamp[:16]}"


def generated(cache_dir: Path | None = None) -> TinyModels | None:
    """The pair if this generator's run completed in the cache, else None;
    read with json alone, for a client venv (no torch, no safetensors): the
    stamp file is written inside the temp dir that is renamed into place
    whole, so a recorded stamp names a finished generation."""
    stamp = params.generator_stamp()
    final = _final(_cache_dir(cache_dir), stamp)
    try:
        recorded = json.loads((final / STAMP_FILE).read_text()).get("stamp")
    except (OSError, ValueError, AttributeError):
        return None
    if recorded != stamp or not (final / "draft" / params.PROBE_FILE).is_file():
        return None
    return TinyModels(target=final / "target", draft=final / "draft")


def ensure_models(
    cache_dir: Path | None = None, progress: Callable[[str], None] = print
) -> TinyModels:
    """Return the model pair, generating it on first use.

    The directory name carries the generator stamp, and a generation happens in
    a temp dir renamed into place only when complete, so a killed run never
    leaves a directory that looks valid."""
    cache_dir = _cache_dir(cache_dir)
    stamp = params.generator_stamp()
    final = _final(cache_dir, stamp)
    models = TinyModels(target=final / "target", draft=final / "draft")
    if _is_complete(final, stamp):
        return models
    cache_dir.mkdir(parents=True, exist_ok=True)
    temp_prefix = f".{final.name}.tmp-"
    # Temp dirs of killed generations: an hour old is surely not running.
    for path in cache_dir.glob(f"{temp_prefix}*"):
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > STALE_TEMP_S:
                shutil.rmtree(path)
    progress(f"tiny-model: generating into {final} (1-2 minutes on 2 cores)")
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix, dir=cache_dir))
    try:
        report = generate(tmp, progress)
        record = {"stamp": stamp, "params": params.generator_params(), "fit": report}
        text = json.dumps(record, indent=2, sort_keys=True, default=list)
        (tmp / STAMP_FILE).write_text(text)
        _install(tmp, final, stamp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return models
