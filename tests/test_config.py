"""configs/ rendering: the one source of every vLLM flag."""

from __future__ import annotations

import json

import pytest

from pdstack import config, serve


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
    with pytest.raises(config.ConfigError, match="bad or missing port"):
        config.ports({"ROUTER_PORT": "http"})


def test_cpu_token_budget_covers_the_longest_prompt() -> None:
    """Without chunked prefill (MLA on CPU) a prompt over the per-step budget
    is never scheduled: the budget must reach max-model-len."""
    cpu = config.target("cpu")["vllm"]
    profiles = sorted(p.stem for p in (config.CONFIGS / "profiles").glob("*.yaml"))
    cpu_profiles = [p for p in profiles if config.profile(p).get("generate")]
    assert cpu_profiles == ["tiny"]
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
