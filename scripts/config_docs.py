"""The docs' tables of configuration keys, generated from the config dataclasses.

Each key is defined once, on its dataclass field (``config_key(default, meaning, unit)``, see
``tiered_kv/values/config_keys.py``); this script writes one table per config class between the
markers ``<!-- generated:config-keys:CLASS -->`` and ``<!-- /generated:config-keys:CLASS -->``:

- README.md: ``StoreConfig`` (the Python API);
- docs/vllm.md: ``ConnectorConfig`` (``kv_connector_extra_config``);
- docs/sglang.md: ``SGLangBackendConfig`` (``--hicache-storage-backend-extra-config``);
- docs/remote.md: ``RemoteKeys`` (the ``remote_*`` keys every front end takes).

To add a key: declare it on its dataclass with ``config_key``, then run this script. To document a
new config class: add it to ``TABLES`` and put the two markers where its table goes.
``tests/test_config_docs.py`` runs ``--check``.

Usage: ``python scripts/config_docs.py`` (rewrite the tables) or ``--check`` (exit 1 with a diff
when a table differs from the code).

Threading contract: a script; main thread only.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.doc_blocks import report, sync  # noqa: E402
from tiered_kv.connector.sglang.config import SGLangBackendConfig  # noqa: E402
from tiered_kv.connector.vllm.config import ConnectorConfig  # noqa: E402
from tiered_kv.store.config import StoreConfig  # noqa: E402
from tiered_kv.tiers.remote.settings import RemoteKeys  # noqa: E402
from tiered_kv.values.config_keys import markdown_table, undocumented  # noqa: E402

#: where each class's table goes, and which of its fields are keys (internal fields such as ``extra`` are not)
TABLES: dict[str, tuple[type, list[str]]] = {
    "README.md": (StoreConfig, StoreConfig.valid_keys()),
    "docs/vllm.md": (ConnectorConfig, ConnectorConfig.valid_keys()),
    "docs/sglang.md": (SGLangBackendConfig, SGLangBackendConfig.valid_keys()),
    "docs/remote.md": (RemoteKeys, [f.name for f in fields(RemoteKeys)]),
}


#: the names of this script's blocks start with it
PREFIX = "config-keys:"


def block_name(cls: type) -> str:
    """The marker name of ``cls``'s table."""
    return PREFIX + cls.__name__


def missing_docs() -> dict[str, list[str]]:
    """Config class -> keys declared without a meaning (empty when every key has one)."""
    out = {cls.__name__: undocumented(cls, keys) for cls, keys in TABLES.values()}
    return {k: v for k, v in out.items() if v}


def wanted(root: Path = ROOT) -> dict[Path, dict[str, str]]:
    """File -> {block name: table} for every table this script writes."""
    return {root / rel: {block_name(cls): markdown_table(cls, keys)} for rel, (cls, keys) in TABLES.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table is stale")
    args = ap.parse_args(argv)
    return report(sync(wanted(), PREFIX, check=args.check), args.check, "python scripts/config_docs.py")


if __name__ == "__main__":
    sys.exit(main())
