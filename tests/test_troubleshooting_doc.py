"""docs/troubleshooting.md against the code: each heading quotes a message the
code prints, so a reworded message leaves no stale entry behind."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pdstack.compose import ROOT

DOC = ROOT / "docs" / "troubleshooting.md"
SOURCES = [
    *sorted((ROOT / "pdstack").glob("*.py")),
    *sorted((ROOT / "plugin" / "src" / "pd_mooncake").glob("*.py")),
    ROOT / "e2e" / "conftest.py",
]
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))
# A cut between pieces: where the code formats a value in.
CUT = "\x00"
# Fragments shorter than this are punctuation around a value (`? (known: `),
# which the code may build from two strings.
MIN_FRAGMENT = 12


def headings() -> list[str]:
    """The quoted messages: `### ` headings in backticks (double backticks
    where the message itself holds one)."""
    found = []
    for line in DOC.read_text().splitlines():
        if m := re.fullmatch(r"### (`+) ?(.+?) ?\1", line):
            found.append(m.group(2))
    return found


def constants(path: Path) -> dict[str, str]:
    """Module-level string constants (``ABORT_ENV = "..."``): the code
    formats them into messages by name."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    out[target.id] = node.value.value
    return out


def literal_text(path: Path) -> str:
    """Every string the module holds, a formatted value resolved where it is
    a string constant (its own, or ``module.NAME`` of a scanned module), else
    a cut; %-style specifiers are cuts too."""
    own = constants(path)
    pieces = []

    def value_of(node: ast.expr) -> str:
        if isinstance(node, ast.Name) and node.id in own:
            return own[node.id]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            for sibling in (p for p in SOURCES if p.stem == node.value.id):
                if node.attr in (names := constants(sibling)):
                    return names[node.attr]
        return CUT

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.JoinedStr):
            pieces.append(
                "".join(
                    part.value
                    if isinstance(part, ast.Constant)
                    else value_of(part.value)
                    for part in node.values
                    if isinstance(part, ast.Constant | ast.FormattedValue)
                )
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            pieces.append(node.value)
    text = CUT.join(pieces)
    return re.sub(r"%[-0-9.]*[sdfr]", CUT, text)


def fragments(message: str) -> list[str]:
    """The message's text between its `<...>` values: the long pieces, or
    for a message that is mostly values, every piece of a word or more."""
    pieces = re.split(r"<[^<>]+>", message)
    long = [f for f in pieces if len(f.strip()) >= MIN_FRAGMENT]
    return long or [f for f in pieces if len(f.strip()) >= 3]


def test_every_heading_is_a_message_of_the_code() -> None:
    texts = {p: literal_text(p) for p in SOURCES}
    texts.update({p: p.read_text() for p in SCRIPTS})
    quoted = headings()
    assert len(quoted) >= 30, quoted
    stale = []
    for message in quoted:
        parts = fragments(message)
        assert parts, f"nothing to look for in {message!r}"
        if not any(all(f in text for f in parts) for text in texts.values()):
            stale.append((message, parts))
    assert stale == [], "quoted, but printed by no module"


def test_the_readme_links_it() -> None:
    assert "docs/troubleshooting.md" in (ROOT / "README.md").read_text()
