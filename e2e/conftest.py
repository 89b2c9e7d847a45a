"""The e2e suite's stack: given by URLs, or the CPU twin started for the session.

    pytest e2e                                  # starts the CPU twin itself
    pytest e2e --router-url http://host:8000 \\
        --prefill-url http://host:8100 --decode-url http://host:8200

Options fall back to E2E_ROUTER_URL, E2E_PREFILL_URL, E2E_DECODE_URL and
E2E_REFERENCE_URL. The colocated reference defaults to the prefill server:
a request sent to it without transfer parameters is served whole by one
engine, with the same model, draft and flags, and no P/D.

What the suite expects is read from the stack under test, and how answers
are judged: README, "What the e2e suite proves".
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from pd_mooncake import staging
from pdstack import client, config, kv_layout, oracle, tiny_model, twin, wait
from pdstack import metrics as m
from pdstack.tiny_model import mtp, mtp_cache

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


def full_install() -> bool:
    """Is this `make install`'s venv (vLLM, torch, transformers), not the
    client's (`make client`: enough to judge a stack given by URLs)?"""
    try:
        return importlib.util.find_spec("vllm") is not None
    except ImportError:  # a meta-path hook that blocks it
        return False


def client_skip(what: str) -> NoReturn:
    """Skip ``what``, which the client venv cannot do. Also at a module's top
    (e2e/test_bench_smoke.py), before its imports."""
    pytest.skip(
        f"{what}: `make install` (this venv is `make client`'s, no vLLM)",
        allow_module_level=True,
    )


def require_full_install(what: str) -> None:
    """Skip ``what`` in the client venv: it starts or builds with vLLM."""
    if not full_install():
        client_skip(what)


def tagged(tag: str) -> Callable[[str], None]:
    """A launcher's progress: each line printed after ``[tag]``, flushed."""
    return lambda line: print(f"[{tag}] {line}", flush=True)


_progress = tagged("twin")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pd stack")
    for name in ("router", "prefill", "decode", "reference"):
        group.addoption(
            f"--{name}-url",
            default=os.environ.get(f"E2E_{name.upper()}_URL"),
            help=f"{name} base URL (env E2E_{name.upper()}_URL)",
        )
    for name, what in (
        ("target-config", "the served target model's config.json"),
        ("draft-config", "the Eagle draft's config.json"),
    ):
        env = f"E2E_{name.upper().replace('-', '_')}"
        group.addoption(
            f"--{name}",
            default=os.environ.get(env),
            help=f"{what} (env {env}; default: the generated tiny pair)",
        )
    group.addoption(
        "--near-tie-epsilon",
        type=float,
        # argparse converts a str default with ``type``.
        default=os.environ.get("E2E_NEAR_TIE_EPSILON") or None,
        help=(
            "0: every token must equal the reference's (the float32 twin's "
            "default; a stack with VLLM_BATCH_INVARIANT=1); otherwise the least noise "
            "band in nats of pdstack.oracle, which calibrates the band on the "
            "stack and accepts a divergence only at a near-tie inside it (env "
            f"E2E_NEAR_TIE_EPSILON; default {oracle.FLOOR} on a stack given by "
            "URLs)"
        ),
    )
    group.addoption(
        "--api-key-file",
        default=os.environ.get("E2E_API_KEY_FILE"),
        help=(
            "a file with the key the stack requires on /v1 (env "
            "E2E_API_KEY_FILE; `make e2e`: compose's secret file); empty or "
            "absent: no key"
        ),
    )
    group.addoption(
        "--compose",
        default=os.environ.get("E2E_COMPOSE"),
        help=(
            "the compose command of the stack under test (env E2E_COMPOSE): "
            "e2e/test_faults_5_compose.py then breaks it with docker"
        ),
    )
    group.addoption(
        "--fault-file",
        default=os.environ.get("E2E_FAULT_FILE"),
        help=(
            "this host's path of the file decode reads as PD_MOONCAKE_FAULT_FILE "
            "(env E2E_FAULT_FILE; docker/compose.e2e.yaml mounts run/e2e-fault)"
        ),
    )


@dataclass
class Stack:
    router: str
    prefill: str
    decode: str
    reference: str
    # A stack this suite started (the twin).
    owned: bool
    run_dir: Path | None = None
    # pdstack.oracle: 0 compares every token; otherwise the band's floor.
    epsilon: float = 0.0
    # Decode's fault switch, as a path on this host (None: not reachable).
    fault_file: Path | None = None
    # The oracle's band once calibrated (``band``): a field, so that a copy
    # made from ``vars()`` (the fault suite's FaultStack) carries it.
    calibrated: oracle.Band | None = None

    def reference_steps(self, prompt: list[int], max_tokens: int) -> list[oracle.Step]:
        """The colocated reference's greedy tokens with their log-probabilities.

        A test asks for its references first: the band is calibrated then,
        before the test's own requests (and the counters it reads)."""
        _ = self.band
        return trace_steps(self.reference, prompt, max_tokens)

    def answer(self, prompt: list[int], max_tokens: int) -> list[oracle.Step]:
        """The P/D answer (through the router), judged like the reference."""
        return trace_steps(self.router, prompt, max_tokens)

    @property
    def band(self) -> oracle.Band:
        """The oracle's band, calibrated on this stack the first time it is
        needed. A test that breaks the stack must ask for it first (the
        negative controls do)."""
        if self.calibrated is None:
            self.calibrated = self._calibrate()
        return self.calibrated

    def _calibrate(self) -> oracle.Band:
        """P/D answers to probe prompts, sent at once (a batch, as on a busy
        GPU), against their references."""
        prompts = [
            self.prompt(24 + 17 * i, salt=9000 + i) for i in range(CALIBRATION_PROMPTS)
        ]
        references = [
            trace_steps(self.reference, p, CALIBRATION_TOKENS) for p in prompts
        ]
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            answers = list(
                pool.map(lambda p: self.answer(p, CALIBRATION_TOKENS), prompts)
            )
        exact = self.epsilon == 0
        band = oracle.calibrate(
            zip(references, answers, strict=True),
            exact=exact,
            floor=None if exact else self.epsilon,
        )
        print(f"[stack] oracle: {band.describe()}")
        return band

    def judge(
        self, reference: list[oracle.Step], answer: list[oracle.Step], label: str
    ) -> oracle.Verdict:
        verdict = oracle.judge(reference, answer, self.band)
        JUDGED.append((label, verdict))
        return verdict

    def prompt(self, length: int, salt: int = 0) -> list[int]:
        """A prompt of exactly ``length`` tokens; ``salt`` makes it distinct."""
        base = _corpus_tokens(self.reference)
        start = (salt * 7919) % len(base)
        tokens = (base[start:] + base) * (length // len(base) + 2)
        return tokens[:length]


# Every answer judged this session: the oracle's report at the end.
JUDGED: list[tuple[str, oracle.Verdict]] = []
# Calibration answers and their tokens: 256 positions at most, 5 candidates
# each. On the bf16 twin 8 of 24 healthy answers moved at all; 16 meet the
# tail of that noise (0.19-0.39 nats) where 8 could miss it.
CALIBRATION_PROMPTS = 16
CALIBRATION_TOKENS = 16


# What a judged request asks for: the best candidates of every position
# keyed by token id (two tokens of the same text stay apart). Five: a flip at
# a near-tie is accepted only to a token the reference rated, and a third
# token can lie as close as the runner-up.
TRACE = {"logprobs": 5, "return_tokens_as_token_ids": True}


def trace_steps(url: str, prompt: list[int], max_tokens: int) -> list[oracle.Step]:
    """Greedy tokens of ``url`` with their candidates' log-probabilities."""
    done = client.complete(url, prompt, max_tokens, **TRACE)
    if done.top_logprobs is None or len(done.top_logprobs) != len(done.token_ids):
        raise client.CompletionError(f"{url}: no top logprobs per token in {done}")
    return oracle.steps(done.token_ids, done.top_logprobs)


SWITCH_HELP = (
    "start decode with PD_MOONCAKE_FAULT_FILE=<path inside its container> and "
    "that directory bind-mounted from this host (docker/compose.e2e.yaml does "
    "both: run/e2e-fault), then pass --fault-file run/e2e-fault/fault "
    "(make e2e does)"
)


def decode_fault_file(stack: Stack) -> Path:
    """Decode's fault switch as this host writes it; skips the test where
    decode does not read one (a stack given by URLs without it)."""
    if stack.fault_file is None:
        pytest.skip(f"no fault switch for decode: {SWITCH_HELP}")
    switch = m.scrape(stack.decode).labels_of(m.KV_CACHE_INFO).get("fault_switch")
    if switch != "file":
        pytest.skip(
            f"decode reports fault_switch={switch!r}, not 'file': {SWITCH_HELP}"
        )
    stack.fault_file.parent.mkdir(parents=True, exist_ok=True)
    return stack.fault_file


def twin_is_exact() -> bool:
    """The twin's greedy output is exact where it serves float32 (the tiny
    profile's cpu target), as vLLM's CPU MLA backend and the transformers
    reference compute; in another dtype it carries that dtype's noise."""
    flags = config.with_env_overrides(
        config.vllm_flags("decode", PROFILE, "cpu"), role="decode"
    )
    return flags.get("dtype") == "float32"


def twin_epsilon() -> float:
    """The oracle's epsilon for a twin this suite starts: 0 (every token)
    where it is exact, else the band's floor."""
    return 0.0 if twin_is_exact() else oracle.FLOOR


@functools.cache
def _corpus_tokens(url: str) -> list[int]:
    return client.tokenize(url, CORPUS * 4)


@pytest.fixture(scope="session")
def probes() -> list[tiny_model.Probe]:
    """Prompts the tiny draft was fitted on, with the target's greedy output.

    Generated locally (deterministic: the same bytes as the stack's own copy).
    The draft predicts the target only on these: a random target is chaotic.
    A client venv cannot generate the pair (torch, transformers): it reads
    the probes of one this host generated before (the twin's, `make model`).
    """
    if is_mtp_profile():
        target = (
            mtp_cache.ensure_mtp_model(progress=_progress)
            if full_install()
            else mtp_cache.generated_mtp()
        )
        if target is None:
            client_skip("the tiny-mtp model's probes (not generated on this host)")
        return mtp_cache.load_mtp_probes(target)
    if full_install():
        return tiny_model.load_probes(tiny_model.ensure_models(progress=_progress))
    models = tiny_model.cache.generated()
    if models is None:
        client_skip("the tiny pair's probes (no pair generated on this host)")
    return tiny_model.load_probes(models)


def pytest_configure(config: pytest.Config) -> None:
    """The stack's API key, for every request to a /v1 path (pdstack.client)."""
    path = config.getoption("api_key_file", default=None)
    if not path or not Path(path).exists():
        return
    try:
        client.use_api_key(Path(path).read_text().strip())
    except OSError as exc:
        pytest.exit(
            f"--api-key-file {path}: {exc.strerror}: compose's secret is readable "
            "by the containers' uid 10001 only? Run as root, or copy the key to a "
            "file of yours and pass E2E_API_KEY_FILE=<that file>",
            2,
        )


# The twin's profile (PD_PROFILE, as `make up-cpu`): tiny (Eagle3 draft) or
# tiny-mtp (the target's MTP layer); the probes and the layout follow it.
PROFILE = os.environ.get("PD_PROFILE", "tiny")


def is_mtp_profile() -> bool:
    return config.profile(PROFILE).get("generate") == "tiny-mtp"


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    opt = request.config.getoption
    epsilon = opt("near_tie_epsilon")
    if opt("router_url"):
        missing = [n for n in ("prefill", "decode") if not opt(f"{n}_url")]
        if missing:
            pytest.exit(f"--router-url given; also give --{missing[0]}-url", 2)
        fault_file = opt("fault_file")
        yield Stack(
            router=opt("router_url"),
            prefill=opt("prefill_url"),
            decode=opt("decode_url"),
            reference=opt("reference_url") or opt("prefill_url"),
            owned=False,
            epsilon=oracle.FLOOR if epsilon is None else epsilon,
            fault_file=Path(fault_file) if fault_file else None,
        )
        return
    require_full_install("the CPU twin (no --router-url given)")
    E2E_RUN_DIR.mkdir(parents=True, exist_ok=True)
    FAULT_FILE.unlink(missing_ok=True)
    urls = twin.up(
        profile=PROFILE,
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
            epsilon=twin_epsilon() if epsilon is None else epsilon,
            fault_file=FAULT_FILE,
        )
    finally:
        twin.down(E2E_RUN_DIR, progress=_progress)


@dataclass(frozen=True)
class Widths:
    """Tensor-parallel ranks per server, as the servers report them."""

    prefill: int
    decode: int


@pytest.fixture(scope="session")
def widths(stack: Stack) -> Widths:
    """Each decode rank pulls its own copy of a request's KV (from one
    prefill rank): a request is ``decode`` transfers."""
    found = {
        name: int(
            m.scrape(getattr(stack, name))
            .labels_of(m.KV_CACHE_INFO)
            .get("tensor_parallel_size")
            or 1
        )
        for name in ("prefill", "decode")
    }
    print(f"[stack] tensor-parallel sizes {found}")
    return Widths(**found)


def staged_descriptors_most(
    length: int, layout: kv_layout.KVLayout, prefill: m.Snapshot, widths: Widths
) -> int:
    """A staged request's descriptor bound: one record per decode rank, each
    that rank's blocks x regions and bytes (staging.record_descriptors)."""
    entries = layout.blocks(kv_layout.tokens_loaded(length)) * layout.layers
    per_rank = int(prefill.total(m.BYTES)) // widths.decode
    return widths.decode * staging.record_descriptors(entries, per_rank)


ModelConfigs = tuple[dict[str, Any], dict[str, Any] | None]


@pytest.fixture(scope="session")
def model_configs(request: pytest.FixtureRequest) -> ModelConfigs:
    """The served models' config.json fields (target, draft or None): the
    options', else the profile's tiny pair's."""
    opt = request.config.getoption
    if opt("target_config"):
        target = kv_layout.read_config(Path(opt("target_config")))
        draft_path = opt("draft_config")
        draft = kv_layout.read_config(Path(draft_path)) if draft_path else None
        return target, draft
    if is_mtp_profile():
        # The MTP layer: one more MLA layer of the target's shapes.
        target = mtp.mtp_config_fields()
        return target, {**target, "num_hidden_layers": mtp.MTP_LAYERS}
    # The tiny pair's, without generating it (no torch in a client venv).
    return tiny_model.layout_configs()


@pytest.fixture(scope="session")
def layout(stack: Stack, model_configs: ModelConfigs) -> kv_layout.KVLayout:
    """What a transfer of this stack moves: the servers' block size and KV
    type, the models' shapes, at decode's tensor-parallel width (each decode
    rank receives its own region, from one prefill rank: with different
    widths on the two roles, pd_mooncake.tp_pairs). Prefill and decode must
    agree on the rest."""
    target, draft = model_configs
    snapshots = {name: m.scrape(getattr(stack, name)) for name in ("prefill", "decode")}
    width = snapshots["decode"].labels_of(m.KV_CACHE_INFO).get("tensor_parallel_size")
    layouts = {}
    for name, snapshot in snapshots.items():
        kv_info = {**snapshot.labels_of(m.KV_CACHE_INFO)}
        if kv_info:
            kv_info["tensor_parallel_size"] = width or "1"
        layouts[name] = kv_layout.served(
            snapshot.labels_of(m.CACHE_CONFIG_INFO), kv_info, target, draft
        )
    print(f"[stack] KV layout: {layouts['decode']}")
    assert layouts["prefill"] == layouts["decode"], layouts
    return layouts["decode"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # The fault cases' figures, whatever the outcome (captured output is not).
    if (faults := sys.modules.get("faults_helpers")) and (rows := faults.table()):
        terminalreporter.write_line("[faults] results")
        for row in rows:
            terminalreporter.write_line(row)
    if not JUDGED:
        return
    band = JUDGED[0][1].band
    flips = [(label, v) for label, v in JUDGED if v.flipped_at is not None]
    label, top = max(JUDGED, key=lambda j: j[1].largest)
    judged = sum(v.judged for _, v in JUDGED)
    near_ties = sum(v.near_ties for _, v in JUDGED)
    terminalreporter.write_line(
        f"oracle: {len(JUDGED)} answers, {judged} tokens judged "
        f"({judged - near_ties} where the reference was confident: another "
        f"token there fails); {band.describe()}; {near_ties} near-ties met, "
        f"{len(flips)} taken another way"
        + (": " + "; ".join(f"{lbl} at token {v.flipped_at}" for lbl, v in flips))
        * bool(flips)
        + f"; largest |Δlogprob| {top.largest:.3g} nats ({label}, token "
        f"{top.largest_at})"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator:
    outcome = yield
    report = outcome.get_result()
    # The stack the test ran on: its own (the fault suite's) or the session's.
    # (Or any stack fixture with a run_dir: the multi-host twin's.)
    dirs = [getattr(v, "run_dir", None) for v in getattr(item, "funcargs", {}).values()]
    run_dir = next((d for d in dirs if isinstance(d, Path)), E2E_RUN_DIR)
    if report.when == "call" and report.failed and run_dir.exists():
        # The servers' own words are usually the diagnosis.
        for log in sorted(run_dir.glob("*.log")):
            report.sections.append(
                (f"tail of {run_dir.name}/{log.name}", wait.tail(log, 30))
            )
