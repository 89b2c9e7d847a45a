"""The stack's configuration, read from configs/: the one source of every vLLM flag.

Compose (through ``pdstack.serve`` inside the image) and the CPU twin both
call :func:`vllm_flags`, so what CI tests is what users deploy; the only
differences are ``configs/targets/<target>.yaml``, kept in one visible place.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from dotenv import dotenv_values

from pdstack import knobs

CONFIGS = Path(
    os.environ.get("PD_CONFIGS", Path(__file__).resolve().parent.parent / "configs")
)
ROLES = ("prefill", "decode")
TARGETS = ("cpu", "gpu")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Ports:
    router: int
    prefill: int
    decode: int
    bootstrap: int
    router_metrics: int

    @property
    def side_channel(self) -> int:
        """Where the prefill's ZMQ side channel listens (its first worker):
        the bootstrap port plus configs/vllm/prefill.yaml's offset."""
        flags = _load(CONFIGS / "vllm" / "prefill.yaml")["kv-transfer-config"]
        offset = flags["kv_connector_extra_config"]["side_channel_port_offset"]
        return self.bootstrap + int(offset)


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines with the quoting and ``${VAR}`` rules compose follows
    (python-dotenv); a bare KEY reads as empty."""
    with path.open() as stream:
        return {key: value or "" for key, value in dotenv_values(stream=stream).items()}


def port_variables() -> dict[str, str]:
    """Each port's variable in configs/ports.env: ``router_metrics`` is
    ROUTER_METRICS_PORT."""
    return {f.name: f"{f.name.upper()}_PORT" for f in dataclasses.fields(Ports)}


def ports(env: Mapping[str, str] | None = None) -> Ports:
    """Ports from configs/ports.env, each overridable by the same-named
    variable; a bad one is named with where its value came from."""
    env = os.environ if env is None else env
    defaults = read_env_file(CONFIGS / "ports.env")
    numbers: dict[str, int] = {}
    for field, var in port_variables().items():
        if var not in env and var not in defaults:
            raise ConfigError(f"configs/ports.env: {var} is missing")
        raw = env.get(var, defaults.get(var, ""))
        where = "the environment" if var in env else "configs/ports.env"
        try:
            number = int(raw)
        except ValueError:
            number = None
        if number is None or knobs.PORT.problem(number):
            raise ConfigError(
                f"{var}={raw!r} (from {where}): expected a port, "
                f"{knobs.PORT.describe()}"
            )
        numbers[field] = number
    if len(set(numbers.values())) < len(numbers):
        shown = ", ".join(f"{port_variables()[f]}={n}" for f, n in numbers.items())
        raise ConfigError(f"two of the stack's ports are the same: {shown}")
    return Ports(**numbers)


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"no such config file: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def profile_names() -> list[str]:
    return sorted(p.stem for p in (CONFIGS / "profiles").glob("*.yaml"))


def twin_profiles() -> list[str]:
    """The profiles whose models are generated locally (``generate:``): the
    only ones the CPU twin can run. A hub profile's settings for the gpu
    target never meet the CPU."""
    return [name for name in profile_names() if profile(name).get("generate")]


def profile(name: str) -> dict[str, Any]:
    path = CONFIGS / "profiles" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(profile_names())
        raise ConfigError(f"unknown profile {name!r}; known: {known}")
    return _load(path)


def target(name: str) -> dict[str, Any]:
    if name not in TARGETS:
        raise ConfigError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    return _load(CONFIGS / "targets" / f"{name}.yaml")


def vllm_flags(role: str, profile_name: str, target_name: str) -> dict[str, Any]:
    """Merged flags, later layers winning: configs/vllm/common.yaml <
    configs/vllm/<role>.yaml < the profile's ``vllm`` < configs/targets/<target>
    < the profile's ``targets.<target>``. Mappings (kv-transfer-config,
    speculative-config) merge key by key, so a profile can change one key of
    the connector's config; a key set to null is removed. Each layer's values
    are checked against pdstack.knobs, naming the file."""
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}; known: {', '.join(ROLES)}")
    chosen = profile(profile_name)
    per_target = chosen.get("targets", {})
    if unknown := sorted(set(per_target) - set(TARGETS)):
        raise ConfigError(
            f"profile {profile_name!r}: unknown target {unknown[0]!r} under "
            f"'targets'; known: {', '.join(TARGETS)}"
        )
    where = f"configs/profiles/{profile_name}.yaml"
    layers = [
        ("configs/vllm/common.yaml", _load(CONFIGS / "vllm" / "common.yaml")),
        (f"configs/vllm/{role}.yaml", _load(CONFIGS / "vllm" / f"{role}.yaml")),
        (f"{where} (vllm)", chosen.get("vllm") or {}),
        (f"configs/targets/{target_name}.yaml", target(target_name).get("vllm", {})),
        (f"{where} (targets.{target_name})", per_target.get(target_name) or {}),
    ]
    merged: dict[str, Any] = {}
    for source, flags in layers:
        check_flags(flags, source)
        merged = merge(merged, flags)
    return merged


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` on ``base``: mappings merged key by key, None removing a key."""
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def check_flags(flags: Mapping[str, Any], source: str) -> None:
    """A ConfigError naming ``source`` and the key, for the first value of
    ``flags`` outside its range or choices (pdstack.knobs)."""
    if not isinstance(flags, Mapping):
        raise ConfigError(f"{source}: expected a mapping of vLLM flags")
    for why in knobs.problems(flags):
        raise ConfigError(f"{source}: {why}")


def substituted(flags: Any, substitutions: Mapping[str, str]) -> Any:
    """``flags`` with ``{name}`` in every string substituted (``{tiny_target}``)."""
    if isinstance(flags, str):
        return flags.format_map(substitutions)
    if isinstance(flags, Mapping):
        return {k: substituted(v, substitutions) for k, v in flags.items()}
    if isinstance(flags, list):
        return [substituted(v, substitutions) for v in flags]
    return flags


def tiny_substitutions(
    profile_name: str, progress: Callable[[str], None]
) -> dict[str, str]:
    """What ``{tiny_target}`` and ``{tiny_draft}`` stand for: the tiny pair
    (``generate: tiny``) or the tiny MTP target (``generate: tiny-mtp``, its
    draft inside), generated first (none for a hub profile)."""
    generate = profile(profile_name).get("generate")
    if generate == "tiny-mtp":
        from pdstack.tiny_model.mtp_cache import ensure_mtp_model

        return {"tiny_target": str(ensure_mtp_model(progress=progress))}
    if generate != "tiny":
        return {}
    from pdstack.tiny_model import ensure_models

    models = ensure_models(progress=progress)
    return {"tiny_target": str(models.target), "tiny_draft": str(models.draft)}


def render(flags: Mapping[str, Any], substitutions: Mapping[str, str]) -> list[str]:
    """Flags as an argv list; ``{name}`` in strings is substituted."""
    argv: list[str] = []
    for key, value in substituted(flags, substitutions).items():
        if value is True:
            argv.append(f"--{key}")
        elif isinstance(value, dict):
            compact = json.dumps(value, separators=(",", ":"), sort_keys=True)
            argv += [f"--{key}", compact]
        elif value is not False and value is not None:
            argv += [f"--{key}", str(value)]
    return argv


def _extra(key: str, kind: type) -> tuple[str, tuple[str, ...], type]:
    """An ENV_OVERRIDES entry for a key of the connector's extra config."""
    return "kv-transfer-config", ("kv_connector_extra_config", key), kind


# Site settings that cannot live in configs/ (they differ per host or per
# replica), set in .env by compose or by Kubernetes: environment variable ->
# (flag, path of keys inside its JSON value (empty: the flag itself), type).
ENV_OVERRIDES: dict[str, tuple[str, tuple[str, ...], type]] = {
    "PD_MOONCAKE_PROTOCOL": _extra("mooncake_protocol", str),
    "PD_MOONCAKE_DEVICE": _extra("device_name", str),
    "PD_GPU_MEMORY_UTILIZATION": ("gpu-memory-utilization", (), float),
    # The model's dtype over the profile's (both roles alike): the CPU twin
    # served in bfloat16, a GPU stack's numerics, instead of its exact
    # float32 (issue 25; the e2e suite then judges it in a calibrated band).
    "PD_DTYPE": ("dtype", (), str),
    # Tensor-parallel width of both roles over the profile's: the CPU twin at
    # TP 2 (one rank per core here; e2e/test_tp_ranks.py). One role's own
    # width: ROLE_ENV_OVERRIDES.
    "PD_TENSOR_PARALLEL_SIZE": ("tensor-parallel-size", (), int),
    # The opt-in KV checksum, on in configs/vllm: 0 runs a stack without it
    # (both roles must agree: set it for prefill and decode alike).
    "PD_MOONCAKE_KV_CHECKSUM": _extra("kv_checksum", bool),
    # MiB of the KV staging buffer (configs/vllm); 0 sends one descriptor per
    # block run, as upstream does. Each role's own: decode offers, prefill
    # accepts.
    "PD_MOONCAKE_KV_STAGING_MIB": _extra("kv_staging_mib", int),
    # One stable engine id per prefill replica (configs/vllm/prefill.yaml:
    # one id for every replica would mix their side channels); Kubernetes sets
    # it to the StatefulSet pod name, which survives a restart.
    "PD_ENGINE_ID": ("kv-transfer-config", ("engine_id",), str),
}
# One role's own value of an ENV_OVERRIDES variable, over the both-roles one:
# variable -> (role, the ENV_OVERRIDES variable whose flag it sets). Prefill
# at a lower tensor-parallel width than decode is llm-d's recommended P/D
# layout; pd_mooncake.tp_pairs says which pairs serve (the geometry handshake
# refuses the others at the first pull, naming the pair).
ROLE_ENV_OVERRIDES: dict[str, tuple[str, str]] = {
    "PD_PREFILL_TENSOR_PARALLEL_SIZE": ("prefill", "PD_TENSOR_PARALLEL_SIZE"),
    "PD_DECODE_TENSOR_PARALLEL_SIZE": ("decode", "PD_TENSOR_PARALLEL_SIZE"),
}
# The words a bool override takes (``bool("false")`` is True).
BOOLS = {
    **dict.fromkeys(("1", "true", "yes", "on"), True),
    **dict.fromkeys(("0", "false", "no", "off"), False),
}


def with_env_overrides(
    flags: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    role: str | None = None,
) -> dict[str, Any]:
    """``flags`` with the ENV_OVERRIDES that are set (non-empty) applied, then
    ``role``'s own (ROLE_ENV_OVERRIDES) over them."""
    env = os.environ if env is None else env
    out = copy.deepcopy(dict(flags))
    settings = [*ENV_OVERRIDES.items()]
    settings += [
        (var, ENV_OVERRIDES[both])
        for var, (own, both) in ROLE_ENV_OVERRIDES.items()
        if own == role
    ]
    for var, (flag, path, kind) in settings:
        if not (raw := env.get(var, "")):
            continue
        try:
            value = BOOLS[raw.strip().lower()] if kind is bool else kind(raw)
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"{var}={raw!r}: expected {kind.__name__}") from exc
        if why := knobs.problem((flag, *path), value):
            raise ConfigError(f"{var}={raw!r}: {why}")
        *parents, last = (flag, *path)
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def server_env(role: str, target_name: str, bootstrap_port: int) -> dict[str, str]:
    env = {str(k): str(v) for k, v in target(target_name).get("env", {}).items()}
    # Where the prefill's Mooncake bootstrap server listens (and decode asks).
    env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap_port)
    return env


# configs/router.yaml's section for pdstack.front (the router's front), not
# vllm-router flags.
FRONT_KEY = "front"


def router_flags() -> dict[str, Any]:
    """configs/router.yaml: the flags every router gets."""
    flags = _load(CONFIGS / "router.yaml")
    flags.pop(FRONT_KEY, None)
    return flags


def front_settings() -> dict[str, Any]:
    """configs/router.yaml's ``front``: pdstack.front's liveness guard."""
    settings = _load(CONFIGS / "router.yaml").get(FRONT_KEY)
    if not isinstance(settings, dict):
        raise ConfigError(f"configs/router.yaml: no '{FRONT_KEY}' mapping")
    return settings


def router_args(
    prefill_url: str,
    bootstrap_port: int,
    decode_url: str,
    host: str,
    port: int,
    metrics_port: int | None = None,
) -> list[str]:
    """vllm-router's flags; each URL may be a comma-separated list of replicas."""
    metrics = ports().router_metrics if metrics_port is None else metrics_port
    argv = [*render(router_flags(), {}), "--host", host, "--port", str(port)]
    # Its exporter binds a fixed port (default 29000): two routers on one host
    # (twin, CI, a benchmark) must each get their own.
    argv += ["--prometheus-port", str(metrics)]
    for url in _split(prefill_url):
        # Every prefill replica runs its own Mooncake bootstrap server.
        argv += ["--prefill", url, str(bootstrap_port)]
    for url in _split(decode_url):
        argv += ["--decode", url]
    return argv


def _split(urls: str) -> list[str]:
    if not (parts := [u.strip() for u in urls.split(",") if u.strip()]):
        raise ConfigError(f"no backend URL in {urls!r}")
    return parts
