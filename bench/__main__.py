"""Command line of the bench:
``python -m bench {run,transfer,hosts-link,checksum,kv-path,report}``."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

from bench import hosts_link as hl
from bench import levels, preflight, report, settings, slo

# The commands on the bench's settings, and what each does.
COMMANDS = {
    "run": "the whole benchmark",
    "transfer": "transfer-engine micro-benchmark only",
    "hosts-link": "the transfer engine between two hosts (network namespaces, "
    "root), unshaped and shaped, against a single TCP stream",
    "checksum": "the KV checksum's cost only: P/D with it on and off, the digest alone",
    "kv-path": "the KV path only: staged and direct sends, fresh and fragmented, "
    "on the bench's own P/D stack; then the engine alone",
    "transfer-cost": "descriptors and transfer threads' CPU per GiB by prompt "
    "length, staged and direct, fresh and fragmented, on the bench's own P/D "
    "stack; then the engine alone at the same bytes",
}
# Each command's own options: (command, flag, help, argparse's keywords).
OPTIONS: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    ("transfer", "--json", "write the samples here", {"type": Path}),
    ("transfer", "--defaults-only", "skip the tuned series", {"action": "store_true"}),
    ("hosts-link", "--json", "write the results here", {"type": Path}),
    ("hosts-link", "--rates", "link rates, tc syntax; `unshaped` for none",
     {"default": ",".join(rate or hl.UNSHAPED for rate in hl.RATES)}),
    ("checksum", "--digest-only", "only the digest, in-process",
     {"action": "store_true"}),
    ("checksum", "--json", "--digest-only: write it here", {"type": Path}),
    ("checksum", "--layout",
     "--digest-only: a run's kv_layout.json (default: the twin's)", {"type": Path}),
)  # fmt: skip
show = functools.partial(print, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {}
    for name, text in COMMANDS.items():
        commands[name] = sub.add_parser(name, help=text)
        settings.add_arguments(commands[name])
    for command, flag, text, more in OPTIONS:
        commands[command].add_argument(flag, help=text, **more)
    rebuild = sub.add_parser("report", help="rebuild a run's report from its JSON")
    rebuild.add_argument("run_dir", type=Path)
    opts = parser.parse_args(argv)
    try:
        if opts.command == "report":
            report.build(opts.run_dir)
            print(opts.run_dir / "report.md")
            return 0
        chosen = settings.from_args(opts)
        if opts.command == "transfer":
            from bench import transfer_engine

            sizes_repeats = (chosen.transfer_sizes, chosen.transfer_repeats)
            samples = transfer_engine.run(*sizes_repeats, progress=show)
            if not opts.defaults_only:
                show(f"  tuned: {transfer_engine.TUNED_ENV}")
                samples += transfer_engine.run_tuned(*sizes_repeats, progress=show)
            if opts.json:
                opts.json.write_text(json.dumps(transfer_engine.to_json(samples)))
            return 0
        if opts.command == "hosts-link":
            links = hl.measure(chosen.hosts_link_size, chosen.hosts_link_repeats,
                               hl.parse_rates(opts.rates), show)  # fmt: skip
            if opts.json:
                opts.json.write_text(json.dumps(hl.to_json(links)))
            print("\n".join(hl.markdown_table(links)), flush=True)
            return 1 if any(r.error for r in links) else 0
        if opts.command == "checksum" and opts.digest_only:
            from bench import kv_checksum

            return kv_checksum.digest_command(chosen.profile, opts.layout, opts.json)
        from bench import run

        chosen.run_dir.mkdir(parents=True, exist_ok=True)
        steps = {"checksum": run.checksum_only, "kv-path": run.kv_path_only,
                 "transfer-cost": run.transfer_cost_only}  # fmt: skip
        steps.get(opts.command, run.run)(chosen)
        return 0
    except (
        settings.SettingsError,
        levels.ReportError,
        hl.HostsLinkError,
        preflight.BenchInputError,
        slo.SloError,
    ) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench: interrupted; servers it started were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
