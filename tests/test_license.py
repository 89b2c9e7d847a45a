"""LICENSE: the Apache License 2.0 the images and the plugin declare."""

from __future__ import annotations

import re

from pdstack.compose import ROOT

SPDX = "Apache-2.0"


def test_license_is_the_full_apache_2_text() -> None:
    text = (ROOT / "LICENSE").read_text()
    words = " ".join(text.split())
    assert words.startswith("Apache License Version 2.0, January 2004")
    # Every one of the nine sections, and the appendix, not an abridgement.
    for number in range(1, 10):
        assert re.search(rf"^\s*{number}\. [A-Z]", text, re.MULTILINE), number
    assert "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text


def test_every_declared_license_is_the_license_file() -> None:
    labels = {
        path.name: re.findall(r'org\.opencontainers\.image\.licenses="([^"]+)"', text)
        for path in sorted((ROOT / "docker").glob("*.Dockerfile"))
        if (text := path.read_text())
    }
    assert labels and all(found == [SPDX] for found in labels.values()), labels
    # tomllib is 3.11's; the project runs on 3.10 too.
    plugin = (ROOT / "plugin" / "pyproject.toml").read_text()
    assert re.findall(r'(?m)^license = "([^"]+)"', plugin) == [SPDX]
