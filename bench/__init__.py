"""`make bench`: P/D against colocated serving, KV transfer cost, router overhead.

    python -m bench run            # the whole benchmark (what `make bench` runs)
    python -m bench transfer       # the Mooncake transfer-engine micro-benchmark alone
    python -m bench report DIR     # rebuild report.md and the plot from a run's JSON

Which modules each step runs in: docs/bench.md's "What runs" (its last
column). Besides those: ``settings`` (the knobs), ``levels`` (a run's results
per level), ``http_tap`` (a recording proxy).
"""
