"""The plugin's patch queue, per vLLM release: ``python -m pd_mooncake.fixes
--report [--source DIR ...]`` (``make fixes-report``).

For the installed vLLM and for each source tree given (a directory holding
``vllm/``, e.g. an unpacked wheel), every fix in ``fixes.FIXES`` is one of:

- attaches: its upstream anchors are there (start-up would use it);
- no longer needed: upstream has what it answers (its ``retired_by`` code),
  whether or not its anchors are still there: a maintainer can delete it once
  no supported release lacks that code;
- NOT ATTACHED: its anchors are gone and upstream does not have what it
  answers: a configuration that relies on it refuses to start there.

Then the queue itself: what each fix answers and when it can be deleted.
Exit status 1 when a release has a fix NOT ATTACHED, so a release the
plugin has stopped covering fails ``make fixes-report``.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

from pd_mooncake import fixes
from pd_mooncake.upstream_source import (
    BASE_FILE,
    CONNECTOR_FILE,
    Attr,
    Calls,
    Method,
    Need,
    SourceView,
)

ATTACHES = "attaches"
RETIRED = "no longer needed"
MISSING = "NOT ATTACHED"


def view_of(root: Path) -> SourceView:
    """The Mooncake connector (and its base) of the vLLM under ``root``."""
    return SourceView(
        (root / CONNECTOR_FILE).read_text(), (root / BASE_FILE).read_text()
    )


def release_of(root: Path) -> str:
    """The version ``root``'s vLLM declares (its setuptools-scm _version.py),
    never imported: another release's package may not import here."""
    version_file = root / "vllm" / "_version.py"
    if version_file.is_file():
        found = re.search(
            r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
            version_file.read_text(),
        )
        if found:
            return found.group(1)
    return "unknown version"


def installed_root() -> Path | None:
    """The directory holding the installed vllm/, found without importing
    it (an import takes half a minute and initialises torch)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parents[1]


def describe(need: Need) -> str:
    """The upstream code a ``retired_by`` need names, as a reader would look
    for it."""
    where = f"{need.owner}." if need.owner else ""
    if isinstance(need, Method):
        return f"{where}{need.name}({', '.join(need.params)})"
    if isinstance(need, Attr):
        return f"{where}{need.name}"
    if isinstance(need, Calls):
        verb = "does not call" if need.absent else "calls"
        return f"{where}{need.method} {verb} {need.callee}"
    return f"{where}{need.method} stores only {', '.join(sorted(need.allowed))}"


def statuses(
    view: SourceView, queue: tuple[fixes.Fix, ...] = fixes.FIXES
) -> dict[str, tuple[str, str]]:
    """fix -> (status, why) on the release ``view`` reads."""
    report = fixes.check(view, queue)
    out = {}
    for fix in queue:
        problems = "; ".join(report.missing.get(fix.name, []))
        if fix.name in report.retired:
            have = ", ".join(map(describe, fix.retired_by))
            anchors = "still attaches" if not problems else f"anchors gone: {problems}"
            out[fix.name] = (RETIRED, f"upstream has {have} ({anchors})")
        elif problems:
            out[fix.name] = (MISSING, problems)
        else:
            out[fix.name] = (ATTACHES, "")
    return out


def release_lines(
    title: str, view: SourceView, queue: tuple[fixes.Fix, ...] = fixes.FIXES
) -> list[str]:
    rows = statuses(view, queue)
    width = max(map(len, rows))
    lines = [title]
    for name, (status, why) in rows.items():
        lines.append(f"  {name:<{width}}  {status}{': ' + why if why else ''}")
    return lines


def queue_lines(queue: tuple[fixes.Fix, ...] = fixes.FIXES) -> list[str]:
    lines = ["The patch queue (pd_mooncake/fixes.py):"]
    for fix in queue:
        lines += [
            f"  {fix.name}",
            f"    answers:     {fix.answers}",
            f"    retire when: {fix.retire_when}",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pd_mooncake.fixes", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--report", action="store_true", required=True, help="print the report"
    )
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        type=Path,
        metavar="DIR",
        help="also report on the vLLM whose source is under DIR (holds vllm/)",
    )
    parser.add_argument(
        "--no-installed",
        action="store_true",
        help="report on the --source trees only",
    )
    args = parser.parse_args(argv)
    installed = None if args.no_installed else installed_root()
    releases = [("installed", installed)] if installed else []
    releases += [("source", root.resolve()) for root in args.source]
    if not releases:
        parser.error("nothing to report on: --source DIR, or the installed vLLM")
    lines: list[str] = []
    gaps = 0
    for kind, root in releases:
        if not (root / CONNECTOR_FILE).is_file():
            parser.error(f"{root} has no {CONNECTOR_FILE}")
        view = view_of(root)
        title = f"vLLM {release_of(root)} ({kind}: {root})"
        lines += [*release_lines(title, view), ""]
        gaps += sum(s == MISSING for s, _ in statuses(view).values())
    lines += queue_lines()
    print("\n".join(lines))
    return 1 if gaps else 0
