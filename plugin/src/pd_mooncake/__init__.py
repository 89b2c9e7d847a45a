"""vLLM general plugin: registers the PD Mooncake connector under its own name.

vLLM's factory lets built-in names win over ``kv_connector_module_path``, so
the connector needs a name of its own ("PDMooncakeConnector"); a built-in
name such as "MooncakeConnector" would silently load upstream's class.
"""

from __future__ import annotations

import logging
import os

CONNECTOR_NAME = "PDMooncakeConnector"
# Kill switch: set to 1 to register nothing and patch nothing (upstream only).
DISABLE_ENV = "PD_MOONCAKE_DISABLE"

logger = logging.getLogger(f"vllm.{__name__}")


def register() -> None:
    """Entry point of ``vllm.general_plugins``; safe to call many times.

    vLLM loads general plugins once per process (API server, engine core,
    workers) and logs-and-swallows their exceptions, so every step here must
    be idempotent and tests must check the outcome, not the absence of errors.
    """
    if os.environ.get(DISABLE_ENV) == "1":
        logger.warning("%s=1: PD Mooncake plugin disabled", DISABLE_ENV)
        return
    # Lazy imports: the entry point must stay importable without vLLM.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "pd_mooncake.connector", "PDMooncakeConnector"
        )

    from pd_mooncake import cpu_support

    cpu_support.apply()
