"""docs/configuration.md against the code: every environment variable of the
project's prefix that the code reads is documented, every documented one is
read, and the ranges and defaults it quotes are the code's and configs/'s."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd_mooncake import extra_config
from pdstack import config, knobs
from pdstack.compose import ROOT

DOC = ROOT / "docs" / "configuration.md"
PREFIX = "PD" + "_"  # spelt apart: this file is code the scan reads
VARIABLE = re.compile(rf"\b{PREFIX}[A-Z0-9_]*[A-Z0-9]\b")
# Where the code lives: everything but the docs (and this file's own words).
CODE_DIRS = (
    "pdstack",
    "plugin",
    "bench",
    "e2e",
    "docker",
    "scripts",
    "k8s",
    "tests",
    ".ci",
)
CODE_FILES = ("compose.yaml", ".env", "Makefile")
SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".env", ".toml", ".cfg", ""}


def code_files() -> Iterator[Path]:
    for name in CODE_DIRS:
        for path in sorted((ROOT / name).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "data" not in path.parts:
                yield path
    yield from (ROOT / name for name in CODE_FILES)


def read_in_code() -> set[str]:
    found: set[str] = set()
    for path in code_files():
        found |= set(VARIABLE.findall(path.read_text(errors="replace")))
    return found


def sections() -> dict[str, list[list[str]]]:
    """Each heading's table rows (cells, stripped), below the header row."""
    out: dict[str, list[list[str]]] = {}
    heading = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("| ") and not line.startswith("| ---"):
            out.setdefault(heading, []).append(
                [cell.strip() for cell in line.strip("|").split(" | ")]
            )
    return {h: rows[1:] for h, rows in out.items()}  # rows[0]: the header


def documented() -> dict[str, list[str]]:
    """Variable -> its row, from every table whose first cells name them."""
    rows: dict[str, list[str]] = {}
    for table in sections().values():
        for row in table:
            for name in VARIABLE.findall(row[0]):
                assert name not in rows, f"{name} documented twice"
                rows[name] = row
    return rows


def test_every_variable_read_is_documented_and_every_documented_one_read() -> None:
    read, doc = read_in_code(), set(documented())
    assert len(read) > 20  # the scan found the code
    assert sorted(read - doc) == [], "read by the code, not in docs/configuration.md"
    assert sorted(doc - read) == [], "in docs/configuration.md, read by nothing"


def test_the_scan_would_see_a_new_variable(tmp_path: Path) -> None:
    """The negative control: a variable in code is found."""
    assert VARIABLE.findall(f'os.environ.get("{PREFIX}NEW_KNOB", "1")') == [
        f"{PREFIX}NEW_KNOB"
    ]


@pytest.mark.parametrize("var", sorted(config.ENV_OVERRIDES))
def test_each_override_row_names_its_flag_range_and_default(var: str) -> None:
    flag, path, kind = config.ENV_OVERRIDES[var]
    row = documented()[var]
    sets, default, allowed = row[1], row[2], row[3]
    assert ".".join(path) in sets or flag in sets, (var, sets)
    if kind is bool:
        words = [w for w, v in config.BOOLS.items() if v] + [
            w for w, v in config.BOOLS.items() if not v
        ]
        assert all(w in allowed for w in words), allowed
    elif rule := knobs.RULES.get((flag, *path)):
        assert allowed.startswith(rule.describe()), (var, allowed)
    elif path[:1] == ("kv_connector_extra_config",) and path[-1] == "mooncake_protocol":
        assert allowed == "one of " + ", ".join(extra_config.PROTOCOLS)
    # The default configs/ gives, where it gives one.
    found, value = knobs.lookup(
        config.vllm_flags("prefill", "tiny", "gpu"), (flag, *path)
    )
    if found:
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        assert f"`{shown}`" in default, (var, default)


def test_every_connector_key_is_documented_with_configs_default() -> None:
    (table,) = [
        rows for h, rows in sections().items() if "kv_connector_extra_config" in h
    ]
    keys = {row[0].strip("`"): row for row in table}
    assert set(keys) == set(extra_config.KNOWN_KEYS)
    for role in config.ROLES:
        extra = config.vllm_flags(role, "tiny", "gpu")["kv-transfer-config"][
            "kv_connector_extra_config"
        ]
        for key, value in extra.items():
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            assert keys[key][1].startswith(f"`{shown}`"), (key, keys[key][1])


def test_quoted_vllm_ranges_are_the_knobs() -> None:
    """The doc's example message is what the check prints."""
    rule = knobs.RULES[("gpu-memory-utilization",)]
    assert f"1.5 is not {rule.describe()}" in DOC.read_text()
    assert knobs.PORT.describe() in DOC.read_text()


def test_docs_speak_in_dates_and_commands() -> None:
    """No internal history words in docs/: a reader needs the date and the
    command of a run, not the project's issue numbers or work stops."""
    words = re.compile(r"\bissue \d+|\bthis stop\b|\bstop \d+\b|\bthe seed\b", re.I)
    for path in sorted((ROOT / "docs").glob("*.md")):
        found = words.findall(path.read_text())
        assert not found, (path.name, found)
