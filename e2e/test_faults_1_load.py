"""Fault suite, load: many concurrent requests of mixed lengths through the
router, each exact, every prompt token loaded from prefill, nothing left.
"""

from __future__ import annotations

import time

import faults_helpers as fh
from pdstack import metrics as m
from pdstack.client import greedy

pytest_plugins = ["faults_stack"]

LOAD_LENGTHS = (5, 16, 17, 40, 64, 65, 130, 300)


def test_load_64_concurrent_mixed_lengths(faults: fh.FaultStack) -> None:
    bodies = [
        greedy(faults.prompt(LOAD_LENGTHS[i % 8], salt=2000 + i), 4 + (i * 5) % 13)
        for i in range(64)
    ]
    expected = fh.references(faults, bodies)
    before = fh.counters(faults)
    start = time.monotonic()
    outcomes = fh.post_all(faults.router, bodies, faults.bounds["request"])
    took = time.monotonic() - start
    failures = [o for o in outcomes if o.status != 200]
    wrong = fh.wrong_answers(outcomes, expected)
    tokens = sum(len(b["prompt"]) for b in bodies)
    d, p = fh.transferred(faults, before, tokens)
    _, found = fh.wait_idle(faults, faults.bounds["idle"])
    fh.record(
        "load: 64 concurrent, 8 prompt lengths 5-300",
        64,
        len(failures) + len(wrong),
        max(o.seconds for o in outcomes),
        found,
        f"load: {took:.1f}s for 64, transfers {p.total(m.TRANSFERS):.0f} "
        f"(failed {p.total(m.FAILED_TRANSFERS):.0f}), decode loaded "
        f"{d.total(m.EXTERNAL_HITS):.0f}/{tokens} prompt tokens",
    )
    assert failures == [], failures[0]
    assert wrong == [], [expected[i].fault(outcomes[i]) for i in wrong]
    assert len({tuple(e.tokens) for e in expected}) > 32, (
        "outputs too alike to prove much"
    )
    # Mooncake batches the requests decode pulls together into one transfer.
    assert 1 <= p.total(m.TRANSFERS) <= 64
    assert p.total(m.FAILED_TRANSFERS) == 0
    # Every prompt token was loaded from prefill; none recomputed on decode.
    assert d.total(m.EXTERNAL_HITS) == tokens
    assert d.by_label(m.PROMPT_TOKENS_BY_SOURCE, "source")["local_compute"] == 0
    assert found == {}
