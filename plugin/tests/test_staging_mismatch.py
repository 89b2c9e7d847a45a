"""Decode stages its pulls, prefill has staging off (``kv_staging_mib: 0`` on
one role only): prefill would write into decode's KV blocks directly, the
path without the late-write protection decode counts on. Prefill refuses
the pull before writing a byte, naming the flag; and decode refuses an
answer to a staged pull that carries no record (a prefill that wrote
directly: staging off, or not this plugin), unless prefill said it sent
nothing (a split pull's other rank: test_split_pull).

The chunked-pull test's workers (real engines and caches) with a buffer
large enough for the request in one span; prefill's buffer taken away as a
worker with staging off has none.
"""

from __future__ import annotations

from typing import Any

import pytest
import test_chunked_pull
from test_chunked_pull import run_pull

from pd_mooncake.staging_worker import StagingWorker

OFF_HERE = "this prefill's kv_staging_mib is 0"
NO_RECORD = "answered a staged pull with no record"


@pytest.fixture
def prefill_without_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    built = test_chunked_pull.worker

    def worker(caches: dict, *, consumer: bool) -> Any:
        w = built(caches, consumer=consumer)
        if not consumer:
            w.staging_bytes, w._arena = 0, None
        return w

    monkeypatch.setattr(test_chunked_pull, "worker", worker)
    # One span holds the whole request: no chunks.
    monkeypatch.setattr(test_chunked_pull, "STAGING_MIB", 4)


def failure(caplog: pytest.LogCaptureFixture) -> str:
    messages = (r.getMessage() for r in caplog.records)
    return " ".join(m for m in messages if "failed" in m)


@pytest.mark.usefixtures("prefill_without_staging")
def test_prefill_without_staging_refuses_a_staged_pull_unwritten(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = run_pull(None)
    print(f"{len(run['writes'])} descriptors; decode: {failure(caplog)[:160]}")
    assert len(run["pulls"]) == 1 and run["pulls"][0].pd_staging
    assert run["writes"] == []
    assert run["meta"].failed and OFF_HERE in failure(caplog)
    # Prefill frees the request: no pull of it will be served.
    assert run["prefill"].finished_sending_reqs == {test_chunked_pull.P_REQ}


@pytest.mark.usefixtures("prefill_without_staging")
def test_negative_control_without_prefills_refusal_decode_refuses_the_answer(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(StagingWorker, "_staging_refusal", lambda self, meta: None)
    run = run_pull(None)
    print(f"control: {len(run['in_kv'])} of {len(run['writes'])} into KV blocks")
    assert run["writes"] and run["in_kv"] == run["writes"]
    assert run["meta"].failed and NO_RECORD in failure(caplog)


@pytest.mark.usefixtures("prefill_without_staging")
def test_negative_control_without_both_checks_the_direct_write_is_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before 2026-12-03 decode took an answer without a record for a
    direct send: the request loaded through the unprotected path."""
    monkeypatch.setattr(StagingWorker, "_staging_refusal", lambda self, meta: None)
    scatter = StagingWorker._staging_scatter

    def old_scatter(self: Any, response: Any, pull_metas: dict) -> None:
        if getattr(response, "pd_staging_record", None) is not None:
            scatter(self, response, pull_metas)

    monkeypatch.setattr(StagingWorker, "_staging_scatter", old_scatter)
    run = run_pull(None)
    assert run["writes"] and run["in_kv"] == run["writes"]
    assert not run["meta"].failed
    assert run["decode"].finished_recving_reqs == {test_chunked_pull.D_REQ}
