"""`make demo`: start the CPU twin, send one request, show the KV transfer evidence.

The twin is always stopped at the end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys

from pdstack import client, tiny_model, twin, wait
from pdstack import metrics as m

# Probe prompts are those the tiny draft was fitted on: there its drafts are
# accepted, so the demo shows speculative decoding at work.
PROBE_LENGTH = 48


def evidence_lines(decode: m.Snapshot, prefill: m.Snapshot, tokens: int) -> list[str]:
    sources = decode.by_label(m.PROMPT_TOKENS_BY_SOURCE, "source")
    regions = prefill.by_label(m.REGION_BYTES, "layout")
    return [
        f"prompt tokens:                 {tokens}",
        "decode, tokens loaded from prefill (external_kv_transfer): "
        f"{sources.get('external_kv_transfer', 0):.0f}",
        "decode, prompt tokens computed locally: "
        f"{sources.get('local_compute', 0):.0f}",
        f"prefill, Mooncake transfers:   {prefill.total(m.TRANSFERS):.0f} "
        f"({prefill.total(m.FAILED_TRANSFERS):.0f} failed)",
        f"prefill, bytes moved:          {prefill.total(m.BYTES):.0f} "
        + ", ".join(f"{k}: {v:.0f}" for k, v in sorted(regions.items())),
        "prefill, transfer time:        "
        f"{prefill.total(m.TRANSFER_SECONDS) * 1e3:.2f} ms",
        f"decode, drafts proposed:       {decode.total(m.SPEC_DRAFTS):.0f}, "
        f"draft tokens accepted {decode.total(m.SPEC_ACCEPTED):.0f} of "
        f"{decode.total(m.SPEC_DRAFT_TOKENS):.0f}",
    ]


def run(profile: str) -> int:
    urls = twin.up(profile, progress=lambda line: print(f"[twin] {line}", flush=True))
    try:
        probes = tiny_model.load_probes(tiny_model.ensure_models())
        prompt = min(probes, key=lambda p: abs(len(p.prompt) - PROBE_LENGTH)).prompt
        decode0, prefill0 = m.scrape(urls.decode), m.scrape(urls.prefill)
        print(f"\nPOST {urls.router}/v1/completions ({len(prompt)} prompt tokens)")
        answer = client.complete(urls.router, prompt, max_tokens=24)
        decode = m.settle(
            urls.decode,
            decode0,
            lambda d: d.total(m.PROMPT_TOKENS_BY_SOURCE) >= len(prompt),
        )
        prefill = m.settle(urls.prefill, prefill0, lambda d: d.total(m.TRANSFERS) >= 1)
        # Random weights: the text is noise; the evidence below is the point.
        print(f"answer token ids: {answer.token_ids}\n\nKV transfer evidence:")
        for line in evidence_lines(decode, prefill, len(prompt)):
            print(f"  {line}")
        moved = decode.total(m.EXTERNAL_HITS) > 0 and prefill.total(m.TRANSFERS) >= 1
        print(
            "\nKV crossed from prefill to decode."
            if moved
            else "\nNO KV TRANSFER SEEN."
        )
        return 0 if moved else 1
    finally:
        twin.down(progress=lambda line: print(f"[twin] {line}", flush=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="tiny")
    opts = parser.parse_args(argv)
    try:
        return run(opts.profile)
    except (wait.WaitError, client.CompletionError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
