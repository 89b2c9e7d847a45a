"""The patch queue report (``python -m pd_mooncake.fixes --report``): on the
installed vLLM, on another release's source (``PD_MOONCAKE_VLLM_SOURCE``,
as test_contract), and on edited copies of the installed source, where an
anchor a fix needs is gone or the code that retires a fix is."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_contract import INSTALLED, other_release

from pd_mooncake import fixes, fixes_report
from pd_mooncake.upstream_source import BASE_FILE, CONNECTOR_FILE


def report(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    """(exit status, fix -> its line) of the report on the trees in argv."""
    status = fixes_report.main(["--report", *argv])
    out = capsys.readouterr().out
    print(out)
    rows = {}
    for line in out.split("\n\n")[0].splitlines()[1:]:
        name, _, rest = line.strip().partition("  ")
        rows[name] = rest.strip()
    return status, rows


def edited_release(tmp_path: Path, old: str, new: str) -> Path:
    """The installed release's connector and base with ``old`` replaced."""
    source = (INSTALLED / CONNECTOR_FILE).read_text()
    assert old in source
    for name, text in (
        (CONNECTOR_FILE, source.replace(old, new)),
        (BASE_FILE, (INSTALLED / BASE_FILE).read_text()),
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    shutil.copy(INSTALLED / "vllm" / "_version.py", tmp_path / "vllm" / "_version.py")
    return tmp_path


def test_every_fix_names_what_it_answers_and_when_to_retire_it() -> None:
    for fix in fixes.FIXES:
        assert len(fix.answers) > 20 and len(fix.retire_when) > 10, fix.name


def test_on_the_installed_release_every_fix_attaches(capsys) -> None:
    status, rows = report(capsys)
    assert status == 0
    assert set(rows) == {f.name for f in fixes.FIXES}
    assert all(r == "attaches" for n, r in rows.items() if n != "registration_backport")
    # 0.32 has PR 39596: the backport is retired there, and still attaches
    # (force_registration_backport compares it with upstream).
    assert rows["registration_backport"].startswith(
        "no longer needed: upstream has MooncakeConnectorWorker."
        "_sync_block_size_with_kernel() (still attaches)"
    )


def test_negative_control_a_fix_whose_anchor_is_gone_is_not_attached(
    capsys, tmp_path: Path
) -> None:
    root = edited_release(
        tmp_path, "def _handle_failed_recv(", "def _handle_failed_receive("
    )
    status, rows = report(capsys, "--no-installed", "--source", str(root))
    assert status == 1
    for name in (
        "dead_prefill_probe",
        "kv_checksum",
        "kv_staging",
        "failed_pull_block_hold",
    ):
        assert rows[name] == (
            "NOT ATTACHED: MooncakeConnectorWorker._handle_failed_recv is missing"
        )
    assert rows["send_retry"] == "attaches"


def test_negative_control_without_the_upstream_fix_the_backport_is_needed(
    capsys, tmp_path: Path
) -> None:
    root = edited_release(
        tmp_path,
        "def _sync_block_size_with_kernel(",
        "def _sync_block_size(",
    )
    _, rows = report(capsys, "--no-installed", "--source", str(root))
    assert rows["registration_backport"] == "attaches"


def test_the_report_runs_as_a_module_and_names_the_release() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pd_mooncake.fixes", "--report"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"vLLM {fixes_report.release_of(INSTALLED)} ")
    assert "The patch queue (pd_mooncake/fixes.py):" in done.stdout


def test_on_the_other_release_no_fix_is_left_without_cover(capsys) -> None:
    """Every fix attaches to PD_MOONCAKE_VLLM_SOURCE's release, or upstream has
    what it answers (make test-compat: vLLM 0.33.0)."""
    root = other_release()
    status, rows = report(capsys, "--no-installed", "--source", str(root))
    assert status == 0, rows
    assert not [n for n, r in rows.items() if r.startswith("NOT ATTACHED")]
