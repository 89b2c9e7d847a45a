"""The e2e suite's stack: given by URLs, or the CPU twin started for the session.

    pytest e2e                                  # starts the CPU twin itself
    pytest e2e --router-url http://host:8000 \\
        --prefill-url http://host:8100 --decode-url http://host:8200

Options fall back to E2E_ROUTER_URL, E2E_PREFILL_URL, E2E_DECODE_URL and
E2E_REFERENCE_URL. The colocated reference defaults to the prefill server:
a request sent to it without transfer parameters is served whole by one
engine, with the same model, draft and flags, and no P/D.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdstack import client, tiny_model, twin, wait

E2E_RUN_DIR = Path(__file__).resolve().parent.parent / "run" / "e2e"
# The plugin's test-only fault switch on the twin's decode: on while it exists.
FAULT_FILE = E2E_RUN_DIR / "fault"
FAULT_FILE_ENV = "PD_MOONCAKE_FAULT_FILE"
# Text from which prompts of exact token lengths are cut.
CORPUS = (
    "The prefill server computes the key and value cache of the prompt and the "
    "decode server receives it over the network, then generates the answer one "
    "token at a time. Operators need proof that the cache really crossed and "
    "arrived intact, so every request is compared with a colocated reference. "
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pd stack")
    for name in ("router", "prefill", "decode", "reference"):
        group.addoption(
            f"--{name}-url",
            default=os.environ.get(f"E2E_{name.upper()}_URL"),
            help=f"{name} base URL (env E2E_{name.upper()}_URL)",
        )


@dataclass
class Stack:
    router: str
    prefill: str
    decode: str
    reference: str
    # Only a stack this suite started has the fault switch.
    owned: bool
    run_dir: Path | None = None

    def prompt(self, length: int, salt: int = 0) -> list[int]:
        """A prompt of exactly ``length`` tokens; ``salt`` makes it distinct."""
        base = _corpus_tokens(self.reference)
        start = (salt * 7919) % len(base)
        tokens = (base[start:] + base) * (length // len(base) + 2)
        return tokens[:length]


_TOKENS: dict[str, list[int]] = {}


def _corpus_tokens(url: str) -> list[int]:
    if url not in _TOKENS:
        _TOKENS[url] = client.tokenize(url, CORPUS * 4)
    return _TOKENS[url]


@pytest.fixture(scope="session")
def probes() -> list[tiny_model.Probe]:
    """Prompts the tiny draft was fitted on, with the target's greedy output.

    Generated locally (deterministic: the same bytes as the stack's own copy).
    The draft predicts the target only on these: a random target is chaotic.
    """
    return tiny_model.load_probes(tiny_model.ensure_models(progress=_progress))


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    opt = request.config.getoption
    if opt("router_url"):
        missing = [n for n in ("prefill", "decode") if not opt(f"{n}_url")]
        if missing:
            pytest.exit(f"--router-url given; also give --{missing[0]}-url", 2)
        yield Stack(
            router=opt("router_url"),
            prefill=opt("prefill_url"),
            decode=opt("decode_url"),
            reference=opt("reference_url") or opt("prefill_url"),
            owned=False,
        )
        return
    E2E_RUN_DIR.mkdir(parents=True, exist_ok=True)
    FAULT_FILE.unlink(missing_ok=True)
    urls = twin.up(
        run_dir=E2E_RUN_DIR,
        progress=_progress,
        role_env={"decode": {FAULT_FILE_ENV: str(FAULT_FILE)}},
    )
    try:
        yield Stack(
            router=urls.router,
            prefill=urls.prefill,
            decode=urls.decode,
            reference=urls.prefill,
            owned=True,
            run_dir=E2E_RUN_DIR,
        )
    finally:
        twin.down(E2E_RUN_DIR, progress=_progress)


def _progress(line: str) -> None:
    print(f"[twin] {line}", flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator:
    outcome = yield
    report = outcome.get_result()
    # The stack the test ran on: its module's own (the fault suite) or the
    # session's.
    run_dir = getattr(item.module, "RUN_DIR", E2E_RUN_DIR)
    if report.when == "call" and report.failed and run_dir.exists():
        # The servers' own words are usually the diagnosis.
        for log in sorted(run_dir.glob("*.log")):
            report.sections.append(
                (f"tail of {run_dir.name}/{log.name}", wait.tail(log, 30))
            )
