"""scripts/gpu-datapath-check on CPU tensors (make test): the staged data
path end to end between two processes over a real Mooncake engine, and its
negative control (a byte changed after prefill's digest fails the check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SCRIPT = SCRIPTS / "gpu-datapath-check"
# The device machine's carry limit (docs/gpu.md, "KV staging memory").
CARRY_BYTES = 64 << 20


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--json", "--layers", "2", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def result(run: subprocess.CompletedProcess) -> dict:
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, run.stdout + run.stderr
    return json.loads(lines[0])


def test_staged_blocks_arrive_verified_without_waiting_on_the_forward_stream() -> None:
    run = check()
    assert run.returncode == 0, run.stdout + run.stderr
    r = result(run)
    assert r["digests_match"] and r["bytes_match"]
    assert r["bytes"] > 0 and r["descriptors"] > 100  # fragmented runs
    # One indexed copy per tensor (2 MLA layers, the draft's K+V tensor).
    assert r["indexed_copies"] == 3
    assert r["device_wide_syncs"] == 0
    assert r["forward_waited"].startswith("no")
    print(json.dumps(r))


def test_the_check_runs_on_a_carried_engine_that_fits_the_carry(tmp_path) -> None:
    """scripts/mooncake-carry from the installed package: the check imports
    the carried engine (not the installed one), which fits in 64 MiB with
    the host libraries it needs."""
    import mooncake

    site = Path(mooncake.__file__).parents[1]
    out = tmp_path / "mooncake-carry"
    subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "mooncake-carry"),
            str(site),
            str(out),
            "--system",
        ],
        check=True,
        timeout=120,
    )
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert size < CARRY_BYTES
    run = check("--mooncake", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    assert result(run)["mooncake"].startswith(str(out))


def test_a_byte_changed_after_the_digest_fails_the_check() -> None:
    run = check("--corrupt")
    assert run.returncode == 1, run.stdout + run.stderr
    r = result(run)
    assert not r["digests_match"] and not r["bytes_match"]
