"""The tiny-mtp model in the model cache, next to the tiny pair: generated
once into a stamped directory, atomically (as cache.ensure_models)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pdstack.tiny_model import params
from pdstack.tiny_model.cache import (
    STAMP_FILE,
    Probe,
    _cache_dir,
    deterministic_torch,
)
from pdstack.tiny_model.mtp import build_mtp, mtp_stamp, save_mtp_target
from pdstack.tiny_model.tokenizer import build_tokenizer


def _final(cache_dir: Path) -> Path:
    return cache_dir / f"pd-tiny-dsv3-mtp-{mtp_stamp()[:16]}"


def _complete(final: Path) -> bool:
    try:
        recorded = json.loads((final / STAMP_FILE).read_text()).get("stamp")
    except (OSError, ValueError, AttributeError):
        return False
    return (
        recorded == mtp_stamp()
        and (final / "target" / "model.safetensors").is_file()
        and (final / "target" / params.PROBE_FILE).is_file()
    )


def generated_mtp(cache_dir: Path | None = None) -> Path | None:
    """The target directory if generated, else None (json only: a client venv)."""
    final = _final(_cache_dir(cache_dir))
    return final / "target" if _complete(final) else None


def load_mtp_probes(target: Path) -> list[Probe]:
    data = json.loads((target / params.PROBE_FILE).read_text())
    return [Probe(p["prompt"], p["greedy"]) for p in data["probes"]]


def ensure_mtp_model(
    cache_dir: Path | None = None, progress: Callable[[str], None] = print
) -> Path:
    """The tiny-mtp target directory (its MTP layer inside), generated on
    first use."""
    cache_dir = _cache_dir(cache_dir)
    final = _final(cache_dir)
    if _complete(final):
        return final / "target"
    cache_dir.mkdir(parents=True, exist_ok=True)
    progress(f"tiny-mtp: generating into {final} (about a minute on 2 cores)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        started = time.monotonic()
        with deterministic_torch():
            tokenizer = build_tokenizer(tmp / "target")
            model, weights, probes, report = build_mtp(tokenizer, progress)
            save_mtp_target(model, weights, tmp / "target")
        (tmp / "target" / params.PROBE_FILE).write_text(
            json.dumps({"max_tokens": params.PROBE_MAX_TOKENS, "probes": probes})
        )
        report["seconds"] = round(time.monotonic() - started, 1)
        progress(f"tiny-mtp: MTP train accuracy {report['train_acc']:.4f} {report}")
        record = {"stamp": mtp_stamp(), "fit": report}
        (tmp / STAMP_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
        tmp.chmod(0o755)
        for path in tmp.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        if final.exists() and not _complete(final):
            shutil.rmtree(final)
        try:
            tmp.rename(final)
        except OSError:
            if not _complete(final):  # a concurrent generator's identical copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / "target"
