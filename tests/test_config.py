"""configs/ rendering: the one source of every vLLM flag."""

from __future__ import annotations

import json
import shlex
import typing
from pathlib import Path

import pytest
import yaml

from pdstack import config, knobs, serve


def test_roles_differ_only_in_kv_role() -> None:
    prefill = config.vllm_flags("prefill", "tiny", "cpu")
    decode = config.vllm_flags("decode", "tiny", "cpu")
    assert {k for k in prefill if prefill[k] != decode[k]} == {"kv-transfer-config"}
    assert prefill["kv-transfer-config"]["kv_role"] == "kv_producer"
    assert decode["kv-transfer-config"]["kv_role"] == "kv_consumer"
    assert prefill["kv-transfer-config"]["kv_connector"] == "PDMooncakeConnector"


def test_render_turns_mappings_into_json_and_true_into_bare_flags() -> None:
    argv = config.render(
        {"enforce-eager": True, "x": False, "cfg": {"a": "{p}"}, "n": 3}, {"p": "/m"}
    )
    assert argv == ["--enforce-eager", "--cfg", '{"a":"/m"}', "--n", "3"]


def test_a_server_bound_to_one_address_advertises_it() -> None:
    """Mooncake advertises get_ip(); unset, that is the first interface: the
    twin (bound to loopback) keeps its KV traffic there, a container (bound to
    every address) advertises its own address."""
    _, twin_env = serve.command("prefill", "kimi-k2.5", "cpu", "127.0.0.1")
    assert twin_env["VLLM_HOST_IP"] == "127.0.0.1"
    assert twin_env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == str(config.ports().bootstrap)
    _, container_env = serve.command("prefill", "kimi-k2.5", "cpu", "0.0.0.0")
    assert "VLLM_HOST_IP" not in container_env


def test_env_overrides_reach_the_connector_config() -> None:
    flags = config.with_env_overrides(
        config.vllm_flags("decode", "tiny", "gpu"),
        {"PD_MOONCAKE_PROTOCOL": "rdma", "PD_MOONCAKE_DEVICE": "mlx5_0"},
    )
    extra = flags["kv-transfer-config"]["kv_connector_extra_config"]
    defaults = {"kv_checksum": True, "kv_staging_mib": 256}
    assert extra == {"mooncake_protocol": "rdma", "device_name": "mlx5_0", **defaults}
    argv = config.render(flags, {"tiny_target": "t", "tiny_draft": "d"})
    rendered = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert rendered["kv_connector_extra_config"]["device_name"] == "mlx5_0"
    # The override did not leak into the loaded configuration.
    base = config.vllm_flags("decode", "tiny", "gpu")["kv-transfer-config"]
    assert base["kv_connector_extra_config"] == {"mooncake_protocol": "tcp", **defaults}


@pytest.mark.parametrize(
    ("var", "raw", "key", "want", "bad"),
    [
        ("PD_MOONCAKE_KV_STAGING_MIB", "0", "kv_staging_mib", 0, "lots"),
        ("PD_MOONCAKE_KV_CHECKSUM", "0", "kv_checksum", False, "maybe"),
        ("PD_MOONCAKE_KV_CHECKSUM", "false", "kv_checksum", False, "maybe"),
        ("PD_MOONCAKE_KV_CHECKSUM", "1", "kv_checksum", True, "maybe"),
    ],
)
def test_the_kv_staging_buffer_and_checksum_follow_the_environment(
    var: str, raw: str, key: str, want: int, bad: str
) -> None:
    for role in config.ROLES:
        base = config.vllm_flags(role, "tiny", "cpu")
        flags = config.with_env_overrides(base, {var: raw})
        got = flags["kv-transfer-config"]["kv_connector_extra_config"][key]
        assert (got, type(got)) == (want, type(want))
    with pytest.raises(config.ConfigError, match=var):
        config.with_env_overrides({}, {var: bad})


def test_the_twin_can_be_served_in_bfloat16() -> None:
    """PD_DTYPE over the tiny profile's float32 on the CPU twin, both roles."""
    for role in config.ROLES:
        base = config.vllm_flags(role, "tiny", "cpu")
        assert base["dtype"] == "float32"
        flags = config.with_env_overrides(base, {"PD_DTYPE": "bfloat16"})
        assert flags["dtype"] == "bfloat16"
        argv = config.render(flags, {"tiny_target": "t", "tiny_draft": "d"})
        assert argv[argv.index("--dtype") + 1] == "bfloat16"


def test_the_twin_can_run_tensor_parallel() -> None:
    """PD_TENSOR_PARALLEL_SIZE on both roles; a width below 1 is refused."""
    for role in config.ROLES:
        base = config.vllm_flags(role, "tiny", "cpu")
        flags = config.with_env_overrides(base, {"PD_TENSOR_PARALLEL_SIZE": "2"})
        argv = config.render(flags, {"tiny_target": "t", "tiny_draft": "d"})
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    with pytest.raises(config.ConfigError, match="PD_TENSOR_PARALLEL_SIZE"):
        config.with_env_overrides(base, {"PD_TENSOR_PARALLEL_SIZE": "0"})


def test_each_role_can_have_its_own_tensor_parallel_width() -> None:
    """PD_<ROLE>_TENSOR_PARALLEL_SIZE over the both-roles width, for its role
    only; the role-less rendering ignores it; its range is checked too."""
    env = {
        "PD_TENSOR_PARALLEL_SIZE": "2",
        "PD_PREFILL_TENSOR_PARALLEL_SIZE": "1",
        "PD_DECODE_TENSOR_PARALLEL_SIZE": "4",
    }
    widths = {
        role: config.with_env_overrides(
            config.vllm_flags(role, "tiny", "cpu"), env, role=role
        )["tensor-parallel-size"]
        for role in config.ROLES
    }
    assert widths == {"prefill": 1, "decode": 4}
    base = config.vllm_flags("decode", "tiny", "cpu")
    assert config.with_env_overrides(base, env)["tensor-parallel-size"] == 2
    with pytest.raises(config.ConfigError, match="PD_DECODE_TENSOR_PARALLEL_SIZE"):
        config.with_env_overrides(
            base, {"PD_DECODE_TENSOR_PARALLEL_SIZE": "0"}, role="decode"
        )


def test_each_prefill_replica_can_have_its_own_engine_id() -> None:
    base = config.vllm_flags("prefill", "tiny", "gpu")
    assert base["kv-transfer-config"]["engine_id"] == "pd-prefill"
    flags = config.with_env_overrides(base, {"PD_ENGINE_ID": "prefill-1"})
    assert flags["kv-transfer-config"]["engine_id"] == "prefill-1"
    # The connector's other settings stay.
    assert flags["kv-transfer-config"]["kv_role"] == "kv_producer"


def test_bad_override_names_the_variable() -> None:
    with pytest.raises(config.ConfigError, match="PD_GPU_MEMORY_UTILIZATION"):
        config.with_env_overrides({}, {"PD_GPU_MEMORY_UTILIZATION": "most"})


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (("router", "tiny", "cpu"), "unknown role"),
        (("prefill", "huge", "cpu"), "unknown profile"),
        (("prefill", "tiny", "tpu"), "unknown target"),
    ],
)
def test_unknown_names_are_config_errors(names: tuple[str, ...], message: str) -> None:
    with pytest.raises(config.ConfigError, match=message):
        config.vllm_flags(*names)


def test_ports_come_from_ports_env_and_the_environment_wins() -> None:
    assert config.ports({}) == config.Ports(8000, 8100, 8200, 8998, 29000)
    assert config.ports({"DECODE_PORT": "9200"}).decode == 9200


@pytest.mark.parametrize("raw", ["abc", "", "0", "65536", "-1", "80.5"])
def test_a_bad_port_names_its_variable_and_where_it_came_from(raw: str) -> None:
    with pytest.raises(config.ConfigError) as bad:
        config.ports({"PREFILL_PORT": raw})
    message = str(bad.value)
    assert message.startswith(f"PREFILL_PORT={raw!r} (from the environment)")
    assert "an integer >= 1 and <= 65535" in message


def test_a_bad_port_in_ports_env_is_blamed_on_the_file(configs: Path) -> None:
    ports_env = configs / "ports.env"
    ports_env.write_text(ports_env.read_text().replace("=8200", "=82OO"))
    with pytest.raises(config.ConfigError, match=r"DECODE_PORT='82OO' \(from configs"):
        config.ports({})


def test_two_ports_the_same_are_refused() -> None:
    with pytest.raises(config.ConfigError, match="DECODE_PORT=8100"):
        config.ports({"DECODE_PORT": "8100"})


def test_cpu_token_budget_covers_the_longest_prompt() -> None:
    """Without chunked prefill (MLA on CPU) a prompt over the per-step budget
    is never scheduled: the budget must reach max-model-len."""
    cpu = config.target("cpu")["vllm"]
    cpu_profiles = config.twin_profiles()
    assert "tiny" in cpu_profiles
    for name in cpu_profiles:
        max_len = int(config.profile(name)["vllm"]["max-model-len"])
        assert int(cpu["max-num-batched-tokens"]) >= max_len, name


def test_tiny_profile_dtype_follows_the_target() -> None:
    """float32 on the CPU twin; on GPUs a dtype CUDA MLA backends accept."""
    assert config.vllm_flags("prefill", "tiny", "cpu")["dtype"] == "float32"
    assert config.vllm_flags("decode", "tiny", "gpu")["dtype"] == "bfloat16"


def test_a_profile_target_section_must_name_a_known_target(configs) -> None:
    bad = configs / "profiles" / "bad.yaml"
    bad.write_text("vllm: {}\ntargets:\n  tpu:\n    dtype: float16\n")
    with pytest.raises(config.ConfigError, match="unknown target 'tpu'"):
        config.vllm_flags("prefill", "bad", "gpu")


def test_env_files_follow_compose_quoting(tmp_path) -> None:
    env = tmp_path / "x.env"
    env.write_text(
        "# comment\nA=1\nB='two words'\nC=\"x # not a comment\"\nD=3 # comment\nE=\n"
    )
    want = {"A": "1", "B": "two words", "C": "x # not a comment", "D": "3", "E": ""}
    assert config.read_env_file(env) == want
    with pytest.raises(FileNotFoundError):
        config.read_env_file(tmp_path / "missing.env")


def test_the_side_channel_port_sits_above_the_bootstrap_port() -> None:
    """It moves with BOOTSTRAP_PORT (config.Ports.side_channel says where)."""
    assert config.ports({}).side_channel == 8999
    assert config.ports({"BOOTSTRAP_PORT": "8988"}).side_channel == 8989


# --- each rendered knob in its range, checked at render time, naming its source -


@pytest.mark.parametrize(
    ("var", "raw", "says"),
    [
        ("PD_GPU_MEMORY_UTILIZATION", "1.5", "> 0 and <= 1"),
        ("PD_GPU_MEMORY_UTILIZATION", "-5", "> 0 and <= 1"),
        ("PD_GPU_MEMORY_UTILIZATION", "0", "> 0 and <= 1"),
        ("PD_GPU_MEMORY_UTILIZATION", "nan", "> 0 and <= 1"),
        ("PD_MOONCAKE_PROTOCOL", "rdmaa", "one of tcp, rdma"),
        ("PD_MOONCAKE_KV_STAGING_MIB", "-1", ">= 0"),
        ("PD_DTYPE", "bf16", "one of auto, half"),
    ],
)
def test_an_override_out_of_range_names_its_variable(
    var: str, raw: str, says: str
) -> None:
    flags = config.vllm_flags("decode", "tiny", "gpu")
    with pytest.raises(config.ConfigError) as bad:
        config.with_env_overrides(flags, {var: raw})
    assert str(bad.value).startswith(f"{var}={raw!r}: ")
    assert says in str(bad.value)


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("PD_GPU_MEMORY_UTILIZATION", "1"),
        ("PD_GPU_MEMORY_UTILIZATION", "0.4"),
        ("PD_MOONCAKE_PROTOCOL", "rdma"),
        ("PD_MOONCAKE_KV_STAGING_MIB", "0"),
    ],
)
def test_an_override_in_range_passes(var: str, raw: str) -> None:
    """The negative control: the bounds themselves are accepted."""
    config.with_env_overrides(config.vllm_flags("decode", "tiny", "gpu"), {var: raw})


def write_profile(configs: Path, name: str, data: dict) -> None:
    (configs / "profiles" / f"{name}.yaml").write_text(yaml.safe_dump(data))


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ({"gpu-memory-utilization": 1.5}, "gpu-memory-utilization: 1.5 is not"),
        ({"tensor-parallel-size": 0}, "tensor-parallel-size: 0 is not"),
        ({"dtype": "bf16"}, "dtype: 'bf16' is not one of auto, half"),
        ({"enforce-eager": "yes"}, "enforce-eager: 'yes' is not true or false"),
        (
            {"kv-transfer-config": {"kv_connector_extra_config": {"kv_staging": 1}}},
            "unknown key 'kv_staging'; did you mean 'kv_staging_mib'?",
        ),
    ],
)
def test_a_profile_value_out_of_range_names_the_file_and_key(
    configs: Path, flags: dict, says: str
) -> None:
    write_profile(configs, "bad", {"vllm": {"model": "m", **flags}})
    with pytest.raises(config.ConfigError) as bad:
        config.vllm_flags("prefill", "bad", "gpu")
    assert str(bad.value).startswith("configs/profiles/bad.yaml (vllm): ")
    assert says in str(bad.value)


def test_every_profile_renders_within_range() -> None:
    for name in config.profile_names():
        for role in config.ROLES:
            for target in config.TARGETS:
                assert not list(knobs.problems(config.vllm_flags(role, name, target)))


def test_the_ranges_are_vllms_own() -> None:
    """Each rule that follows a vLLM field has that field's bounds and
    choices (its pydantic metadata and typing.Literal)."""
    import importlib

    modules = {"CacheConfig": "cache", "ModelConfig": "model"}
    modules |= {"ParallelConfig": "parallel", "SchedulerConfig": "scheduler"}
    modules |= {"SpeculativeConfig": "speculative", "KVTransferConfig": "kv_transfer"}
    followed = {path: rule for path, rule in knobs.RULES.items() if rule.vllm}
    assert len(followed) >= 9
    for path, rule in followed.items():
        cls_name, field = rule.vllm.split(".")
        module = importlib.import_module(f"vllm.config.{modules[cls_name]}")
        info = getattr(module, cls_name).__pydantic_fields__[field]
        bounds = {
            type(m).__name__: getattr(m, type(m).__name__.lower())
            for m in info.metadata
        }
        low_key = "Gt" if rule.low_open else "Ge"
        assert bounds.get(low_key) == rule.low, path
        assert bounds.get("Le") == rule.high, path
        literals = [a for a in typing.get_args(info.annotation) if a is not None]
        choices = [c for a in literals for c in (typing.get_args(a) or [a])]
        choices = [c for c in choices if isinstance(c, str)]
        assert tuple(choices) == rule.choices, path


# --- merging: a profile can change one key of the connector's config -----------


def test_a_profile_changes_one_key_of_the_connector_config(configs: Path) -> None:
    extra = {"kv_staging_mib": 1024, "kv_checksum": None}
    write_profile(
        configs,
        "mine",
        {
            "vllm": {
                "model": "m",
                "kv-transfer-config": {"kv_connector_extra_config": extra},
            }
        },
    )
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        kv = config.vllm_flags(role, "mine", "gpu")["kv-transfer-config"]
        assert kv["kv_role"] == kv_role  # the role file's keys stay
        assert kv["kv_connector_extra_config"]["kv_staging_mib"] == 1024
        assert kv["kv_connector_extra_config"]["mooncake_protocol"] == "tcp"
        assert "kv_checksum" not in kv["kv_connector_extra_config"]  # null: removed
    # The environment still wins over the profile.
    flags = config.vllm_flags("decode", "mine", "gpu")
    over = config.with_env_overrides(flags, {"PD_MOONCAKE_KV_STAGING_MIB": "0"})
    assert (
        over["kv-transfer-config"]["kv_connector_extra_config"]["kv_staging_mib"] == 0
    )


def test_merge_is_deep_for_mappings_only() -> None:
    base = {"a": {"x": 1, "y": [1]}, "b": 1}
    assert config.merge(base, {"a": {"y": [2]}, "b": {"z": 1}}) == {
        "a": {"x": 1, "y": [2]},
        "b": {"z": 1},
    }
    assert base == {"a": {"x": 1, "y": [1]}, "b": 1}  # not mutated


# --- pdstack.serve ---------------------------------------------------------------


def serve_print(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    role: str = "decode",
) -> str:
    for name in {
        *config.port_variables().values(),
        *config.ENV_OVERRIDES,
        *config.ROLE_ENV_OVERRIDES,
    }:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    serve.main(["--role", role, "--target", "gpu", "--profile", "kimi-k2.5", "--print"])
    return capsys.readouterr().out


def test_serve_print_is_one_command_a_shell_runs_as_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = serve_print(monkeypatch, capsys, {"PD_ENGINE_ID": "pod 0"}, "prefill")
    (line,) = out.splitlines()
    words = shlex.split(line)
    assert words[0] == "env" and "VLLM_MOONCAKE_BOOTSTRAP_PORT=8998" in words
    argv = words[words.index("-m") - 1 :]
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["engine_id"] == "pod 0"
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "eagle3"


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"PREFILL_PORT": "abc"}, "PREFILL_PORT='abc' (from the environment)"),
        ({"PD_GPU_MEMORY_UTILIZATION": "1.5"}, "PD_GPU_MEMORY_UTILIZATION='1.5'"),
        ({"PD_MOONCAKE_PROTOCOL": "rdmaa"}, "PD_MOONCAKE_PROTOCOL='rdmaa'"),
        ({"PD_PREFLIGHT": "maybe"}, "PD_PREFLIGHT='maybe'"),
    ],
)
def test_serve_refuses_a_bad_knob_naming_it(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    says: str,
) -> None:
    with pytest.raises(SystemExit) as stop:
        serve_print(monkeypatch, capsys, env)
    assert stop.value.code == 2
    assert says in capsys.readouterr().err


def test_serve_names_pd_profile_for_an_unknown_profile(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PD_PROFILE", "kimi")
    with pytest.raises(SystemExit):
        serve.main(["--role", "decode", "--target", "gpu", "--print"])
    assert "PD_PROFILE='kimi': no such profile; known:" in capsys.readouterr().err


def test_a_hub_profile_may_set_any_gpu_flag(configs: Path) -> None:
    """Only profiles the CPU twin runs must match it flag for flag."""
    write_profile(
        configs,
        "hub",
        {
            "vllm": {"model": "org/m"},
            "targets": {"gpu": {"enable-expert-parallel": True}},
        },
    )
    assert "hub" not in config.twin_profiles()
    assert config.vllm_flags("decode", "hub", "gpu")["enable-expert-parallel"] is True
