"""compose.yaml: schema, invariants, and the vLLM flags it gives prefill and decode.

No Docker engine is needed: every test reads the model the real Compose CLI
renders, and each invariant returns its violations (tests/manifests.py says why).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import itertools
import json
import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from pd_mooncake import metric_names as names
from pdstack import config, prometheus
from pdstack.compose import COMPOSE, DOTENV, PORTS_ENV, ROOT
from tests import manifests
from tests.manifests import HEALTH, compose_cli, compose_config, environment, ports

DASHBOARDS = ROOT / "docker" / "monitoring" / "grafana" / "dashboards"
PROVISIONING = ROOT / "docker" / "monitoring" / "grafana" / "provisioning"
# Opt-in override for `make e2e`: prefill and decode HTTP on 127.0.0.1.
E2E_OVERRIDE = ROOT / "docker" / "compose.e2e.yaml"
# Run-time state (gitignored): a bind mount from here may not exist yet.
RUNTIME = ROOT / "run"

TRIOS = (manifests.TCP_TRIO, manifests.RDMA_TRIO)
SERVERS = {
    name: role
    for trio in TRIOS
    for name, role in zip(trio[:2], config.ROLES, strict=True)
}
ROUTERS = {trio[2]: trio[:2] for trio in TRIOS}
# What may be published on the host, and where.
PUBLISHED_OK = {"router": "ROUTER_PORT"}
LOOPBACK_ONLY = {"grafana"}


def compose_files() -> list[Path]:
    """compose.yaml and the files it includes (for the checks on the sources)."""
    includes = yaml.safe_load(COMPOSE.read_text()).get("include", [])
    return [COMPOSE, *(ROOT / entry["path"] for entry in includes)]


PROFILES = compose_cli("config", "--profiles").stdout.split()
PROFILE_SETS = [
    combo
    for n in range(len(PROFILES) + 1)
    for combo in itertools.combinations(PROFILES, n)
]
# Every combination of profiles, named e.g. "default" or "monitoring+rdma".
each_profile_set = pytest.mark.parametrize(
    "profiles", PROFILE_SETS, ids=lambda p: "+".join(p) or "default"
)


# --- invariant checkers: each returns a list of violations --------------------


def healthcheck_violations(model: Mapping[str, Any]) -> list[str]:
    problems = []
    for name in model["services"].keys() & {*SERVERS, *ROUTERS}:
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
        if len(urls) != 1 or not urls[0].endswith(HEALTH):
            problems.append(f"{name}: health check must GET localhost ...{HEALTH}")
        if name in SERVERS and not check.get("start_period"):
            problems.append(f"{name}: model loading needs a start_period")
    return problems


def router_dependency_violations(model: Mapping[str, Any]) -> list[str]:
    problems = []
    for router in sorted(ROUTERS.keys() & model["services"].keys()):
        depends = model["services"][router].get("depends_on") or {}
        for server in ROUTERS[router]:
            if depends.get(server, {}).get("condition") != "service_healthy":
                problems.append(f"{router} must depend on {server}: service_healthy")
    return problems


def published(model: Mapping[str, Any]) -> dict[str, list[tuple[str, str, str]]]:
    """Each service's published ports: (host ip, published port, target port)."""
    return {
        name: [
            (str(p.get("host_ip", "")), str(p.get("published", "")), str(p["target"]))
            for p in service.get("ports") or []
        ]
        for name, service in model["services"].items()
    }


def port_violations(model: Mapping[str, Any]) -> list[str]:
    problems = []
    for name, service in model["services"].items():
        for entry, (host_ip, host_port, target) in zip(
            service.get("ports") or [], published(model)[name], strict=True
        ):
            if name in PUBLISHED_OK:
                port = ports()[PUBLISHED_OK[name]]
                if (host_port, target) != (port, port):
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
        host_network = service.get("network_mode") == "host"
        if host_network and "rdma" not in service.get("profiles", []):
            problems.append(f"{name}: host networking outside profile rdma")
    return problems


def gpu_violations(model: Mapping[str, Any]) -> list[str]:
    problems = []
    for name, service in model["services"].items():
        resources = service.get("deploy", {}).get("resources", {})
        devices = (resources.get("reservations") or {}).get("devices", [])
        for device in devices:
            if "device_ids" in device and "count" in device:
                problems.append(f"{name}: `count` beside `device_ids`")
            capabilities = device.get("capabilities", [])
            if device.get("driver") != "nvidia" or "gpu" not in capabilities:
                problems.append(f"{name}: GPU reservation needs nvidia + [gpu]")
        if name in SERVERS and not any("device_ids" in d for d in devices):
            problems.append(f"{name}: GPUs must be pinned with device_ids")
    return problems


def secret_violations(model: Mapping[str, Any]) -> list[str]:
    problems = []
    defined = set(model.get("secrets") or {})
    for name, service in model["services"].items():
        mounted = service.get("secrets", [])
        if undefined := {s["source"] for s in mounted} - defined:
            problems.append(f"{name}: undefined secrets {sorted(undefined)}")
        files = {s["target"] for s in mounted}
        problems += manifests.secret_env_violations(name, environment(service), files)
        # vllm-router 0.1.17 relays requests without a key: servers that
        # required one refused every request on the CPU compose stack.
        if name in ("prefill", "decode") and "PD_API_KEY_FILE" in environment(service):
            problems.append(f"{name}: requires an API key the router never presents")
    return problems


def reference_violations(model: Mapping[str, Any]) -> list[str]:
    """Dangling references, and bind mounts of files that are not there."""
    problems = []
    services = model["services"]
    volumes = set(model.get("volumes") or {})
    configs = set(model.get("configs") or {})
    for name, service in services.items():
        for other in service.get("depends_on") or {}:
            if other not in services:
                problems.append(f"{name}: depends on inactive or missing {other}")
        for volume in service.get("volumes", []):
            source = volume["source"]
            if volume["type"] == "volume" and source not in volumes:
                problems.append(f"{name}: undefined volume {source}")
            # Compose creates a missing bind source as an empty directory
            # (the CLI marks every short-syntax bind so): right for run-time
            # state, a broken mount for anything else.
            path = Path(source)
            bind = volume["type"] == "bind"
            if bind and not path.exists() and not path.is_relative_to(RUNTIME):
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


def check_jsonschema(
    *files: Path | str, **options: Any
) -> subprocess.CompletedProcess[str]:
    schema = ("--builtin-schema", "vendor.compose-spec")
    return manifests.run(manifests.tool("check-jsonschema"), *schema, *files, **options)


def test_compose_files_match_the_compose_spec() -> None:
    result = check_jsonschema(*compose_files(), E2E_OVERRIDE)
    assert result.returncode == 0, result.stdout + result.stderr


@each_profile_set
def test_resolved_model_matches_the_compose_spec(profiles: tuple[str, ...]) -> None:
    result = check_jsonschema("-", input=json.dumps(compose_config(profiles)))
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_rejects_a_broken_model() -> None:
    model = compose_config()
    prefill = model["services"]["prefill"]
    prefill["helthcheck"] = prefill.pop("healthcheck")
    assert check_jsonschema("-", input=json.dumps(model)).returncode != 0


def test_profiles_are_the_documented_ones() -> None:
    assert PROFILES == ["monitoring", "rdma"]


# --- invariants ----------------------------------------------------------------


@each_profile_set
def test_invariants_hold(profiles: tuple[str, ...]) -> None:
    model = compose_config(profiles)
    assert [p for check in (*CHECKERS, port_violations) for p in check(model)] == []


def test_default_run_is_the_tcp_trio_publishing_only_the_router_port() -> None:
    port = ports()["ROUTER_PORT"]
    assert published(compose_config()) == {
        "prepare": [],
        "prefill": [],
        "decode": [],
        "router": [("", port, port)],
    }


def test_naming_the_rdma_router_runs_exactly_the_rdma_trio() -> None:
    # `docker compose up router-rdma`: its profile is enabled by naming it.
    model = compose_config(options=["router-rdma"])
    # With the one-shot that generates the profile's models first.
    assert set(model["services"]) == {*manifests.RDMA_TRIO, "prepare"}


def test_e2e_override_publishes_only_prefill_and_decode_http_on_loopback() -> None:
    files = (COMPOSE, E2E_OVERRIDE)
    result = compose_cli(
        "config", "--format", "json", files=files, env_files=(DOTENV, PORTS_ENV)
    )
    assert result.returncode == 0, result.stderr
    model = json.loads(result.stdout)
    port = ports()
    assert published(model) == {
        "prepare": [],
        "prefill": [("127.0.0.1", port["PREFILL_PORT"], port["PREFILL_PORT"])],
        "decode": [("127.0.0.1", port["DECODE_PORT"], port["DECODE_PORT"])],
        "router": [
            ("", port["ROUTER_PORT"], port["ROUTER_PORT"]),
            ("127.0.0.1", port["ROUTER_METRICS_PORT"], port["ROUTER_METRICS_PORT"]),
        ],
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
        assert model["services"][name]["environment"]["VLLM_BATCH_INVARIANT"] == "0"
    # Without configs/ports.env the override stops with a clear message.
    result = compose_cli("config", "--quiet", files=files)
    assert result.returncode != 0
    assert "pass --env-file configs/ports.env" in result.stderr


def test_healthcheck_checker_catches_violations() -> None:
    model = compose_config()
    without_fail = ["CMD", "curl", "-sS", "http://localhost:8100/health"]
    model["services"]["prefill"]["healthcheck"]["test"] = without_fail
    model["services"]["decode"]["healthcheck"]["test"][-1] = "http://localhost:1/"
    del model["services"]["decode"]["healthcheck"]["start_period"]
    problems = healthcheck_violations(model)
    assert any(p.startswith("prefill: health check must be `curl -f") for p in problems)
    assert any(p.startswith("decode: health check must GET") for p in problems)
    assert any(p.startswith("decode: model loading") for p in problems)


def test_router_dependency_checker_catches_violations() -> None:
    model = compose_config()
    depends_on = model["services"]["router"]["depends_on"]
    depends_on["decode"] = {"condition": "service_started"}
    assert router_dependency_violations(model) == [
        "router must depend on decode: service_healthy"
    ]


def test_port_checker_catches_violations() -> None:
    model = compose_config(["monitoring"])
    model["services"]["decode"]["ports"] = [{"target": 8200, "published": "8200"}]
    model["services"]["grafana"]["ports"] = [{"target": 3000, "published": "3000"}]
    model["services"]["router"]["ports"] = [{"target": 8000, "published": "9999"}]
    model["services"]["prefill"]["network_mode"] = "host"
    problems = port_violations(model)
    assert len(problems) == 4, problems


def test_gpu_checker_catches_violations() -> None:
    model = compose_config()
    devices = model["services"]["prefill"]["deploy"]["resources"]["reservations"]
    devices["devices"][0]["count"] = 1
    del model["services"]["decode"]["deploy"]
    assert gpu_violations(model) == [
        "decode: GPUs must be pinned with device_ids",
        "prefill: `count` beside `device_ids`",
    ]


def test_secret_checker_catches_violations() -> None:
    model = compose_config()
    model["services"]["prefill"]["environment"]["HF_TOKEN"] = "hf_abc"
    model["services"]["router"]["environment"]["ROUTER_API_KEY_FILE"] = "/tmp/key"
    model["services"]["decode"]["environment"]["PD_API_KEY_FILE"] = (
        "/run/secrets/grafana_admin_password"
    )
    model["services"]["decode"]["secrets"].append({"source": "x", "target": "/x"})
    assert secret_violations(model) == [
        "decode: undefined secrets ['x']",
        "decode: PD_API_KEY_FILE is not a file from a secret",
        "decode: requires an API key the router never presents",
        "prefill: secret HF_TOKEN as a plain value",
        "router: ROUTER_API_KEY_FILE is not a file from a secret",
    ]


def test_reference_checker_catches_violations() -> None:
    model = compose_config(["monitoring", "rdma"])
    del model["services"]["decode-rdma"]
    grafana = model["services"]["grafana"]["volumes"]
    grafana[0]["source"] = str(ROOT / "docker" / "monitoring" / "missing")
    grafana[-1]["source"] = "grafana-dat"
    assert reference_violations(model) == [
        f"grafana: bind source {ROOT}/docker/monitoring/missing does not exist",
        "grafana: undefined volume grafana-dat",
        "router-rdma: depends on inactive or missing decode-rdma",
    ]


def test_required_settings_fail_fast(tmp_path: Path) -> None:
    dotenv = tmp_path / ".env"
    dotenv.write_text(re.sub(r"(?m)^PD_PROFILE=.*$", "", DOTENV.read_text()))
    # The shell wins over .env: an empty PD_PROFILE must stop Compose too.
    for result in (
        compose_cli("config", "--quiet", env_files=(dotenv,)),
        compose_cli("config", "--quiet", env={"PD_PROFILE": ""}),
    ):
        assert result.returncode != 0
        assert "set PD_PROFILE in .env" in result.stderr


def test_ports_come_from_ports_env_and_can_be_overridden() -> None:
    assert manifests.port_numbers_in(compose_files()) == {}
    # configs/ports.env reaches the included file, the shell wins.
    model = compose_config(env={"ROUTER_PORT": "9000"})
    assert published(model)["router"] == [("", "9000", "9000")]
    prefill_url = f"http://prefill:{ports()['PREFILL_PORT']}"
    assert model["services"]["router"]["environment"]["PREFILL_URL"] == prefill_url


# --- .env: every knob documented, no secret values ------------------------------


def test_every_knob_is_documented_in_dotenv() -> None:
    # Each KEY=value line of .env, set or commented out.
    pattern = r"(?m)^\s*#?([A-Z][A-Z0-9_]*)=(.*?)\s*$"
    documented = dict(re.findall(pattern, DOTENV.read_text()))
    # Each variable -> its default in the compose files as the CLI reads them;
    # None where compose has none to give (required; build args, which the
    # unnormalized model alone keeps, pass through unset).
    used: dict[str, str | None] = {
        name: None if variable["Required"] else variable["DefaultValue"]
        for name, variable in compose_config(options=["--variables"]).items()
    }
    raw = compose_config(PROFILES, options=["--no-normalize"])
    for service in raw["services"].values():
        used.update(dict.fromkeys((service.get("build") or {}).get("args") or {}))
    for name in sorted(used.keys() - ports().keys()):
        assert name in documented, f"{name} is used by compose but not in .env"
        if used[name] is not None and documented[name]:
            assert documented[name] == used[name], f"{name}: .env and compose disagree"


def test_dotenv_holds_no_secret_values() -> None:
    for key in filter(manifests.SECRET_NAME.search, config.read_env_file(DOTENV)):
        assert key.endswith(manifests.SECRET_REF_SUFFIXES), key


# --- the vLLM flags compose gives prefill and decode -----------------------------

# configs/profiles/ the CPU twin runs (generated models). A hub profile's
# per-target settings (`targets.gpu`) are its own business: it never runs on
# the CPU, so they differ from nothing the twin tests.
MODEL_PROFILES = config.twin_profiles()
# configs/targets/cpu.yaml's `vllm:` keys and a twin profile's own per-target
# settings: what the CPU twin changes for a CPU. Nothing else may differ from
# a GPU host.
DEVICE_DIFFERENCES = {
    "block-size",
    "dtype",
    "enforce-eager",
    "max-num-seqs",
    "max-num-batched-tokens",
    "kv-cache-memory-bytes",
}


def test_documented_device_differences_are_the_target_files() -> None:
    vllm = [config.target(name).get("vllm", {}) for name in config.TARGETS]
    profiles = [config.profile(name).get("targets", {}) for name in MODEL_PROFILES]
    per_target = [settings or {} for p in profiles for settings in p.values()]
    assert set().union(*vllm, *per_target) == DEVICE_DIFFERENCES


def flag_differences(gpu: Mapping[str, Any], cpu: Mapping[str, Any]) -> set[str]:
    return {key for key in gpu.keys() | cpu.keys() if gpu.get(key) != cpu.get(key)}


@pytest.mark.parametrize("role", config.ROLES)
@pytest.mark.parametrize("profile", MODEL_PROFILES)
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
    assert flag_differences(gpu, cpu) <= set(config.target("cpu").get("env", {}))


def test_flag_comparison_catches_an_extra_difference() -> None:
    cpu = config.vllm_flags("decode", "tiny", "cpu")
    gpu = {**config.vllm_flags("decode", "tiny", "gpu"), "max-model-len": 4096}
    assert flag_differences(gpu, cpu) - DEVICE_DIFFERENCES == {"max-model-len"}


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_compose_runs_pdstack_serve_for_its_role_on_gpu(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    command = compose_config(PROFILES)["services"][name]["command"]
    role = SERVERS[name]
    opts = dict(zip(command[3::2], command[4::2], strict=True))
    # The target is the image's (PD_TARGET: gpu unless built with TARGET=cpu).
    assert opts == {"--role": role}
    # The real CLI, no stubs; kimi-k2.5 needs no model generation to print.
    kimi = [*command, "--profile", "kimi-k2.5"]
    # One shell-quoted line: env, the assignments, then vLLM's argv.
    (line,) = manifests.served(kimi, {}, monkeypatch, capsys).splitlines()
    words = shlex.split(line)
    env_words, argv = words[1 : words.index("-m") - 1], words[words.index("-m") - 1 :]
    assert words[0] == "env"
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_role"] == manifests.KV_ROLE[role]
    assert argv[argv.index("--port") + 1] == ports()[f"{role.upper()}_PORT"]
    assert f"VLLM_MOONCAKE_BOOTSTRAP_PORT={ports()['BOOTSTRAP_PORT']}" in env_words
    assert not {"--enforce-eager", "--block-size"} & set(argv)


def test_router_trio_urls_point_at_its_own_servers() -> None:
    services = compose_config(PROFILES)["services"]
    port = ports()
    for router, (prefill, decode) in ROUTERS.items():
        env = environment(services[router])
        host = "localhost" if services[router].get("network_mode") == "host" else None
        assert env["PREFILL_URL"] == f"http://{host or prefill}:{port['PREFILL_PORT']}"
        assert env["DECODE_URL"] == f"http://{host or decode}:{port['DECODE_PORT']}"
        assert env["BOOTSTRAP_PORT"] == port["BOOTSTRAP_PORT"]


def test_rdma_servers_select_the_rdma_protocol() -> None:
    services = compose_config(["rdma"])["services"]
    for name in ("prefill-rdma", "decode-rdma"):
        service = services[name]
        env = environment(service)
        assert env["PD_MOONCAKE_PROTOCOL"] == "rdma"
        assert env["WITH_NVIDIA_PEERMEM"] in {"0", "1"}
        assert service["network_mode"] == "host"
        assert "IPC_LOCK" in service["cap_add"]
        assert service["ulimits"]["memlock"] == -1
        devices = {(d["source"], d["target"]) for d in service["devices"]}
        assert ("/dev/infiniband", "/dev/infiniband") in devices
    for name in ("prefill", "decode"):
        assert "PD_MOONCAKE_PROTOCOL" not in environment(services[name])


# --- monitoring ------------------------------------------------------------------

REQUIRED_METRICS = {
    names.CHECKSUM_MATCH,
    names.CHECKSUM_MISMATCH,
    names.BYTES,
    names.TRANSFERS,
    names.FAILED_TRANSFERS,
    names.FAILED_RECVS,
    names.TRANSFER_TIME,
    names.REGION_BYTES,
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
    v1 = Path(spec.submodule_search_locations[0]) / "v1"
    found = {v for v in vars(names).values() if str(v).startswith("vllm:")}
    sources = ("metrics/loggers.py", "spec_decode/metrics.py")
    text = "".join((v1 / path).read_text() for path in sources)
    return found | set(re.findall(r"\"(vllm:[a-z0-9_]+)\"", text))


def dashboard_metrics(dashboard: Mapping[str, Any]) -> set[str]:
    exprs = " ".join(expr for _, expr in prometheus.panel_queries(dashboard))
    return {SERIES_SUFFIX.sub("", s) for s in re.findall(r"vllm:[a-z0-9_]+", exprs)}


def test_dashboard_uses_existing_metrics_and_covers_the_required_ones() -> None:
    (path,) = DASHBOARDS.glob("*.json")
    used = dashboard_metrics(json.loads(path.read_text()))
    assert used - known_metrics() == set()
    assert used >= REQUIRED_METRICS


def test_dashboard_check_catches_a_misspelt_metric() -> None:
    target = {"expr": "rate(vllm:mooncake_byte_total[1m])"}
    dashboard = {"panels": [{"targets": [target]}]}
    assert dashboard_metrics(dashboard) - known_metrics() == {"vllm:mooncake_byte"}


def test_prometheus_scrapes_the_stack_on_its_ports() -> None:
    model = compose_config(["monitoring"])
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
    grafana = compose_config(["monitoring"])["services"]["grafana"]
    binds = [v for v in grafana["volumes"] if v["type"] == "bind"]
    mounts = {Path(v["source"]): v["target"] for v in binds}
    (provider_file,) = (PROVISIONING / "dashboards").glob("*.yaml")
    provider = yaml.safe_load(provider_file.read_text())["providers"][0]
    assert mounts[DASHBOARDS] == provider["options"]["path"]
    assert mounts[PROVISIONING] == "/etc/grafana/provisioning"
    home = environment(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DASHBOARDS / Path(home).name).is_file()


def test_compose_keeps_servers_private_non_root_and_secrets_out(tmp_path: Path) -> None:
    """With real secret files, in the model of every profile combination:
    only the router is published, no service runs as root or privileged, and
    no secret value reaches the rendered output (the images' final USER:
    tests/test_docker.py). Moved from the e2e fault suite: it needs no stack."""
    secrets = {}
    env = config.read_env_file(DOTENV)
    for name in ("hf_token", "api_key", "grafana_admin_password"):
        secrets[name] = f"{name}-{os.urandom(8).hex()}"
        (tmp_path / name).write_text(secrets[name])
        env[f"{name.upper()}_FILE"] = str(tmp_path / name)
    problems: list[str] = []
    models = [compose_config(profiles, env) for profiles in PROFILE_SETS]
    for model in models:
        problems += port_violations(model) + secret_violations(model)
        for name, service in model["services"].items():
            if str(service.get("user", "")).split(":")[0] in ("0", "root"):
                problems.append(f"{name}: runs as root")
            if service.get("privileged"):
                problems.append(f"{name}: privileged")
    rendered = json.dumps(models)
    default = published(compose_config((), env))
    internal = {ports()[k] for k in ("PREFILL_PORT", "DECODE_PORT", "BOOTSTRAP_PORT")}
    exposed = {port for entries in default.values() for _, port, _ in entries}
    assert problems == []
    assert [name for name, entries in default.items() if entries] == ["router"]
    assert not internal & exposed
    assert [name for name, value in secrets.items() if value in rendered] == []


# --- the overrides: a CPU host, the compose fault cases -----------------------

CPU_OVERRIDE = ROOT / "docker" / "compose.cpu.yaml"
FAULTS_OVERRIDE = ROOT / "docker" / "compose.faults.yaml"


def rendered(*overrides: Path) -> dict[str, Any]:
    result = compose_cli(
        "config",
        "--format",
        "json",
        files=(COMPOSE, *overrides),
        env_files=(PORTS_ENV, DOTENV),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_cpu_override_runs_the_cpu_image_without_gpus_on_a_benchmark_subnet() -> None:
    model = rendered(CPU_OVERRIDE, E2E_OVERRIDE)
    services = model["services"]
    for name in ("prepare", "prefill", "decode"):
        assert services[name]["image"].endswith("-cpu"), services[name]["image"]
    for name in ("prefill", "decode"):
        assert services[name]["build"]["args"]["TARGET"] == "cpu"
        assert "deploy" not in services[name]
    # Docker Engine 20.10 refuses start_interval (Engine 25+).
    for name, service in services.items():
        assert "start_interval" not in (service.get("healthcheck") or {}), name
    (pool,) = model["networks"]["default"]["ipam"]["config"]
    assert ipaddress.ip_network(pool["subnet"]).subnet_of(
        ipaddress.ip_network("198.19.0.0/16")
    )
    # Everything else the static checks demand still holds (no GPUs to pin).
    checks = [check for check in CHECKERS if check is not gpu_violations]
    assert [p for check in checks for p in check(model)] == []


def test_faults_override_sets_the_fault_suites_server_timings() -> None:
    """docker/compose.faults.yaml is configs/faults.yaml's `env`, no more."""
    faults = yaml.safe_load((config.CONFIGS / "faults.yaml").read_text())["env"]
    override = yaml.safe_load(FAULTS_OVERRIDE.read_text())["services"]
    assert {role: s["environment"] for role, s in override.items()} == faults
    services = rendered(CPU_OVERRIDE, FAULTS_OVERRIDE)["services"]
    for role, env in faults.items():
        assert {k: environment(services[role])[k] for k in env} == env
