"""`make bench`: P/D against colocated serving, KV transfer cost, router overhead.

    python -m bench run            # the whole benchmark (what `make bench` runs)
    python -m bench transfer       # the Mooncake transfer-engine micro-benchmark alone
    python -m bench report DIR     # rebuild report.md and the plot from a run's JSON

Modules: ``settings`` (the knobs), ``stack`` (start/stop the servers the bench
owns), ``vllm_bench`` (vLLM's own ``vllm bench serve``, run in a subprocess),
``kv_transfer`` (the plugin's transfer metrics per request), ``router_capture``
(the router's protocol read off the wire; stub backends), ``router_overhead``
(router vs the same two legs sent directly), ``http_tap`` (a recording proxy),
``transfer_engine`` (Mooncake alone vs loopback socket and memcpy ceilings),
``loopback`` (two processes with Mooncake engines: the bench's and the plugin
tests' harness), ``memory`` (peak resident memory), ``levels`` (a run's results
per level), ``targets`` (each target judged), ``report`` (Markdown, PNG,
summary).
"""
