"""README.md and docs/: every relative link reaches a file, and every
`#anchor` a heading of it, as GitHub names them (the docs moved their figures
to docs/evidence.md and link there by heading)."""

from __future__ import annotations

import re
from pathlib import Path

from pdstack.compose import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped but hyphens and
    underscores, each space a hyphen."""
    found = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not (m := re.match(r"#{1,6} (.+)", line)):
            continue
        text = m.group(1).strip().lower()
        found.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return found


def test_relative_links_reach_a_file_and_heading() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            file_part, _, anchor = target.partition("#")
            path = (doc.parent / file_part).resolve() if file_part else doc
            if not path.exists():
                broken.append((doc.name, target, "no such file"))
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append((doc.name, target, "no such heading"))
    assert broken == []
