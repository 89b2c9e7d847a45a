"""Bad connector configuration fails at start-up, naming the key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import KVTransferConfig

from pd_mooncake import CONNECTOR_NAME, extra_config
from pd_mooncake.connector import PDMooncakeConnector


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"mooncake_protocl": "tcp"},
            "unknown key 'mooncake_protocl'.*'mooncake_protocol'",
        ),
        (
            {"mooncake_protocol": "udp"},
            r"mooncake_protocol'\] must be one of tcp, rdma",
        ),
        ({"num_workers": "4"}, r"num_workers'\] must be int"),
        ({"num_workers": True}, r"num_workers'\] must be int"),
        ({"num_workers": 0}, r"num_workers'\] must be >= 1"),
        ({"device_name": 3}, r"device_name'\] must be str"),
    ],
)
def test_bad_extra_config_names_the_key(extra: dict, message: str) -> None:
    with pytest.raises(extra_config.ExtraConfigError, match=message):
        extra_config.validate(extra)


def test_good_extra_config_passes() -> None:
    extra_config.validate(
        {"mooncake_protocol": "rdma", "device_name": "mlx5_0", "num_workers": 4}
    )
    extra_config.validate({})


def test_connector_rejects_bad_config_before_starting_anything() -> None:
    """Through the connector's constructor, as vLLM builds it at start-up."""
    kv_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_role="kv_producer",
        kv_connector_extra_config={"mooncake_protocol": "udp"},
    )
    with pytest.raises(extra_config.ExtraConfigError, match="mooncake_protocol"):
        PDMooncakeConnector(SimpleNamespace(kv_transfer_config=kv_config), None)
