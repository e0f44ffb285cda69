"""vLLM general plugin: makes ``TieredKVConnector`` a connector name vLLM knows, so no module path is needed.

The package declares ``register`` under the ``vllm.general_plugins`` entry-point group
(pyproject.toml). vLLM calls every general plugin in each of its processes (the front end when
it parses ``--kv-transfer-config``, the EngineCore process, every GPU worker) before it resolves
the connector, so once ``tiered_kv`` is installed::

    --kv-transfer-config '{"kv_connector":"TieredKVConnector","kv_role":"kv_both"}'

finds the class through vLLM's own registry (``KVConnectorFactory.register_connector``, which
imports the module lazily, on first use). The module-path form (``kv_connector_module_path:
tiered_kv.connector.vllm``) keeps working: vLLM imports a module path before it looks at the
registry.

``register`` is idempotent (vLLM may call plugins more than once per process, and a user may call
it too) and harmless without vLLM: it returns False and imports nothing of ours beyond this module.
Set ``VLLM_PLUGINS`` to a list without ``tiered_kv`` to keep vLLM from calling it.

Threading contract: ``register`` runs at process start-up, on the thread that loads vLLM's
plugins; it is not meant to race itself.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: The name ``kv_connector`` takes, and where vLLM finds the class behind it.
CONNECTOR_NAME = "TieredKVConnector"
CONNECTOR_MODULE = "tiered_kv.connector.vllm"
CONNECTOR_CLASS = "TieredKVConnector"
#: The entry point's name in ``vllm.general_plugins`` (what ``VLLM_PLUGINS`` lists to allow it).
PLUGIN_NAME = "tiered_kv"


def register() -> bool:
    """Register ``TieredKVConnector`` with vLLM's connector factory; True if this call registered it.

    False when vLLM is not installed in this environment, or when the name is registered already (an
    earlier call in this process): nothing to do in either case.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # tiered_kv without vLLM (the Python API, SGLang): nothing to register with
        log.debug("tiered_kv vLLM plugin: vLLM is not importable here; %s not registered", CONNECTOR_NAME)
        return False
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    except ValueError:  # vLLM refuses a second registration of a name: ours from an earlier call
        log.debug("tiered_kv vLLM plugin: %s was registered already in this process", CONNECTOR_NAME)
        return False
    log.debug("tiered_kv vLLM plugin: registered %s -> %s.%s", CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    return True
