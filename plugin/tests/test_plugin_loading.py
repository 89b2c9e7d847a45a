"""The plugin loads through vLLM's own plugin loader and its name resolves.

vLLM logs and swallows a plugin's import errors, so these tests check that
registration really happened, in fresh interpreters.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import yaml

import pd_mooncake

PROBE = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as B
print(F._registry["{name}"]().__name__ if "{name}" in F._registry else "absent")
print(B.get_supported_kernel_block_sizes())
"""


def probe(**env: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(name=pd_mooncake.CONNECTOR_NAME)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **env},
        check=True,
    )
    return result.stdout.strip().splitlines()[-2:]


def test_entry_point_is_declared() -> None:
    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "pd_mooncake:register" in names


def test_vllm_plugin_loader_registers_the_connector() -> None:
    connector, block_sizes = probe()
    assert connector == "PDMooncakeConnector"
    assert block_sizes == "[MultipleOf(16)]"


def test_kill_switch_leaves_upstream_alone() -> None:
    """Negative control: with the plugin disabled nothing is registered."""
    connector, block_sizes = probe(**{pd_mooncake.DISABLE_ENV: "1"})
    assert connector == "absent"
    assert block_sizes == "[MultipleOf(32)]"


def test_registration_is_idempotent() -> None:
    pd_mooncake.register()
    pd_mooncake.register()  # the factory raises on a taken name: must not here
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory._registry[pd_mooncake.CONNECTOR_NAME]()
    assert cls.__module__ == "pd_mooncake.connector"


def test_builtin_name_is_not_shadowed() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    pd_mooncake.register()
    upstream = KVConnectorFactory._registry["MooncakeConnector"]()
    assert upstream.__module__.startswith("vllm.")


ROOT = Path(__file__).resolve().parents[2]


def published_names() -> dict[str, str]:
    """The connector names users are told to use: both roles' vLLM configs
    (compose, Kubernetes and the twin render these) and the README's example."""
    names = {
        f"configs/vllm/{role}.yaml": yaml.safe_load(
            (ROOT / "configs" / "vllm" / f"{role}.yaml").read_text()
        )["kv-transfer-config"]["kv_connector"]
        for role in ("prefill", "decode")
    }
    readme = (ROOT / "README.md").read_text()
    names["README.md"] = re.search(r'"kv_connector": "([^"]+)"', readme).group(1)
    return names


def test_connector_name_is_the_published_one() -> None:
    """Every published name resolves, through vLLM's factory, to this
    plugin's connector (a built-in or stale name would load another class)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    pd_mooncake.register()
    resolved = {
        where: (
            f"{cls.__module__}.{cls.__name__}"
            if (cls := KVConnectorFactory._registry.get(name, lambda: None)())
            else f"{name}: not registered"
        )
        for where, name in published_names().items()
    }
    assert resolved == dict.fromkeys(
        resolved, "pd_mooncake.connector.PDMooncakeConnector"
    )
