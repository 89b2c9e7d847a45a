"""pdstack.metrics: the plugin's series by the plugin's own names, read without vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdstack import metrics as m


def test_metric_names_come_from_the_plugin_without_importing_vllm() -> None:
    code = (
        "import sys; from pdstack import metrics as m; "
        "print(m.TRANSFERS, sorted({'vllm', 'torch'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split(maxsplit=1)
    assert out == ["vllm:mooncake_transfers_total", "[]\n"]


def snapshot(transfers: float) -> m.Snapshot:
    return m.Snapshot({(m.TRANSFERS, frozenset()): transfers})


def test_settle_returns_the_first_delta_done_or_the_last_one_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scraped = iter(range(100))
    monkeypatch.setattr(
        m, "scrape", lambda _url, _timeout=10.0: snapshot(next(scraped))
    )
    before = snapshot(0)
    done = m.settle("http://x", before, lambda d: d.total(m.TRANSFERS) >= 3, 5.0, 0.01)
    assert done.total(m.TRANSFERS) == 3
    # Never done: the last delta, for the caller's assertions to show.
    last = m.settle("http://x", before, lambda d: False, 0.2, 0.05)
    assert last.total(m.TRANSFERS) > 3
