"""Command line of the bench:
``python -m bench {run,transfer,hosts-link,checksum,kv-path,report}``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import levels, report, settings
from bench.hosts_link import HostsLinkError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    settings.add_arguments(sub.add_parser("run", help="the whole benchmark"))
    transfer = sub.add_parser("transfer", help="transfer-engine micro-benchmark only")
    settings.add_arguments(transfer)
    transfer.add_argument("--json", type=Path, help="write the samples here")
    transfer.add_argument(
        "--defaults-only", action="store_true", help="skip the tuned series"
    )
    hosts = sub.add_parser(
        "hosts-link",
        help="the transfer engine between two hosts (network namespaces, root), "
        "unshaped and shaped, against a single TCP stream",
    )
    settings.add_arguments(hosts)
    hosts.add_argument("--json", type=Path, help="write the results here")
    hosts.add_argument(
        "--rates",
        default="unshaped,1gbit,5gbit",
        help="link rates, tc syntax; `unshaped` for none",
    )
    check = sub.add_parser(
        "checksum",
        help="the KV checksum's cost only: P/D with it on and off, the digest alone",
    )
    settings.add_arguments(check)
    check.add_argument(
        "--digest-only", action="store_true", help="only the digest, in-process"
    )
    check.add_argument("--json", type=Path, help="--digest-only: write it here")
    check.add_argument(
        "--layout",
        type=Path,
        help="--digest-only: a run's kv_layout.json (default: the twin's)",
    )
    settings.add_arguments(
        sub.add_parser(
            "kv-path",
            help="the KV path only: staged and direct sends, fresh and "
            "fragmented, on the bench's own P/D stack; then the engine alone",
        )
    )
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

            def show(line: str) -> None:
                print(line, flush=True)

            samples = transfer_engine.run(
                chosen.transfer_sizes, chosen.transfer_repeats, progress=show
            )
            if not opts.defaults_only:
                show(f"  tuned: {transfer_engine.TUNED_ENV}")
                samples += transfer_engine.run_tuned(
                    chosen.transfer_sizes, chosen.transfer_repeats, progress=show
                )
            if opts.json:
                opts.json.write_text(json.dumps(transfer_engine.to_json(samples)))
            return 0
        if opts.command == "hosts-link":
            return _hosts_link(chosen, opts.rates, opts.json)
        if opts.command == "checksum" and opts.digest_only:
            from bench import kv_checksum

            return kv_checksum.digest_command(chosen.profile, opts.layout, opts.json)
        from bench import run

        chosen.run_dir.mkdir(parents=True, exist_ok=True)
        commands = {"checksum": run.checksum_only, "kv-path": run.kv_path_only}
        commands.get(opts.command, run.run)(chosen)
        return 0
    except (settings.SettingsError, levels.ReportError, HostsLinkError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench: interrupted; servers it started were stopped", file=sys.stderr)
        return 130


def _hosts_link(chosen: settings.Settings, rates: str, out: Path | None) -> int:
    from bench import hosts_link

    def show(line: str) -> None:
        print(line, flush=True)

    results = hosts_link.measure(
        chosen.hosts_link_size,
        chosen.hosts_link_repeats,
        hosts_link.parse_rates(rates),
        progress=show,
    )
    if out:
        out.write_text(json.dumps(hosts_link.to_json(results)))
    for line in hosts_link.markdown_table(results):
        show(line)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
