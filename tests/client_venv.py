"""Python as `make client`'s venv runs it, from inside the twin's venv.

    python tests/client_venv.py -m pytest e2e --collect-only ...
    python tests/client_venv.py -c "import some_module"

A meta-path hook makes vLLM, torch, and every installed package that
requirements/client.txt does not bring unimportable (ModuleNotFoundError, as
if absent), so a test sees what the client venv would without building it.
The checkout's pdstack and plugin/src come from the path (the caller's
PYTHONPATH), as `make e2e` gives them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import re
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLIENT_PINS = ROOT / "requirements" / "client.txt"
# Blocked whatever the pin file says: what the client venv exists to avoid.
ALWAYS_BLOCKED = frozenset({"torch", "vllm"})
# This checkout's own packages: from the path, never installed in the client.
PROJECT = frozenset({"pdstack", "bench", "pd_mooncake"})


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def client_distributions(pins: Path = CLIENT_PINS) -> set[str]:
    """The distributions requirements/client.txt names (pinned or not)."""
    names = set()
    for line in pins.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.add(canonical(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0]))
    return names


def blocked_modules() -> frozenset[str]:
    """Top-level modules of the installed distributions the client lacks."""
    allowed = client_distributions()
    blocked = {
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if not allowed & {canonical(d) for d in dists}
    }
    return frozenset((blocked | ALWAYS_BLOCKED) - PROJECT)


class Blocker(importlib.abc.MetaPathFinder):
    def __init__(self, blocked: frozenset[str]) -> None:
        self.blocked = blocked

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: object = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".", 1)[0] in self.blocked:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} (not in the client venv)",
                name=fullname,
            )
        return None


def main(argv: list[str]) -> None:
    sys.meta_path.insert(0, Blocker(blocked_modules()))
    # As `python -m`/`-c` would: the working directory first, not tests/ (whose
    # conftest would shadow e2e's).
    sys.path[0] = ""
    # The client venv has no pytest plugins; the twin's (anyio's) would be
    # loaded from its entry points, and fail behind the hook.
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[:1] == ["-c"]:
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.exit("usage: client_venv.py -m MODULE [ARGS...] | -c CODE")


if __name__ == "__main__":
    main(sys.argv[1:])
