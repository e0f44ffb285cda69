"""Run by ``test_wheel.py`` with the python of a fresh venv that holds only the built wheel (and sees an engine).

``python venv_checks.py COMMAND ...`` prints one JSON line of findings; the test asserts on them.

- ``requirements EXTRA``: the installed ``tiered_kv``'s declared requirements (its own, plus those of
  ``EXTRA``) that this venv does not satisfy (a name missing or a version outside the specifier).
- ``vllm REPO KV_TRANSFER_JSON``: what vLLM's EngineCore process does: the connector's name is unknown
  to vLLM's factory before plugins load; ``vllm.plugins.load_general_plugins()`` (EngineCore and every
  worker call it first) runs the installed package's ``vllm.general_plugins`` entry point; the name then
  resolves to ``TieredKVConnector`` from the wheel, and vLLM's real ``Scheduler`` builds the connector
  from a config without ``kv_connector_module_path``; a turn-2 prompt loads its prefix from the CPU
  tier (the test harness plays the worker on CPU tensors).
- ``sglang``: SGLang's loader of ``dynamic`` storage backends imports our backend class by the
  ``module_path``/``class_name`` the README gives; it comes from the wheel and is a ``HiCacheStorage``.

The checkout (REPO) is appended to ``sys.path``, after site-packages, only for the test harness
(``tests.connector.vllm.harness``): ``tiered_kv`` itself must come from the venv's site-packages,
which every command reports (``from_wheel``).

Threading contract: a script; runs on its main thread.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile


def _from_venv(module) -> bool:
    """Whether ``module`` was imported from this interpreter's venv (not from the checkout)."""
    return os.path.realpath(module.__file__).startswith(os.path.realpath(sys.prefix) + os.sep)


def _origin() -> dict:
    import tiered_kv

    return {"tiered_kv_file": tiered_kv.__file__, "from_wheel": _from_venv(tiered_kv), "version": tiered_kv.__version__}


def unmet_requirements(extra: str) -> dict:
    """Requirements of the installed ``tiered_kv`` (and of ``extra``) this venv does not meet."""
    from importlib.metadata import PackageNotFoundError, distribution, version

    from packaging.requirements import Requirement

    unmet, checked = [], []
    for line in distribution("tiered_kv").requires or ():
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        checked.append(str(req))
        try:
            have = version(req.name)
        except PackageNotFoundError:
            unmet.append(f"{req}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req}: have {have}")
    return {**_origin(), "checked": checked, "unmet": unmet}


def vllm_by_name(repo: str, ktc_json: str) -> dict:
    """The connector named without a module path, through vLLM's plugin loading and its real Scheduler."""
    sys.path.append(repo)  # after site-packages: the harness from the checkout, tiered_kv from the wheel
    found = _origin()
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    ktc = KVTransferConfig(**json.loads(ktc_json))
    found["module_path"] = ktc.kv_connector_module_path
    try:
        KVConnectorFactory.get_connector_class(ktc)
        found["known_before_plugins"] = True
    except ValueError:
        found["known_before_plugins"] = False
    load_general_plugins()
    cls = KVConnectorFactory.get_connector_class(ktc)
    found["class"] = f"{cls.__module__}.{cls.__qualname__}"
    found["class_from_wheel"] = _from_venv(sys.modules[cls.__module__])
    found.update(_turn2_hit(cls, ktc.kv_connector_extra_config))
    return found


def _turn2_hit(cls, extra: dict) -> dict:
    """Turn 1 stores its prefix, the GPU forgets it, turn 2 loads it from the CPU tier."""
    from tests.connector.vllm.harness import BS, Engine, write_model_dir

    extra = {"chunk_blocks": 4, "cpu_bytes": 64 * 4 * 4096, **extra}
    with tempfile.TemporaryDirectory(prefix="tkv-wheel-") as tmp:
        eng = Engine.create(write_model_dir(os.path.join(tmp, "tiny-llama")), extra, module_path=None)
        try:
            first = eng.add("turn1", [100 + (7919 + i * 31) % 800 for i in range(8 * BS + 4)], max_tokens=2)
            eng.run()
            eng.settle()
            eng.sched.reset_prefix_cache()  # the GPU forgets turn 1: turn 2 must come from our CPU tier
            eng.add("turn2", list(first.prompt_token_ids) + list(first.output_token_ids) + [5] * 40, max_tokens=2)
            eng.run()
            eng.settle()
            return {"scheduler": type(eng.sched).__name__, "scheduler_connector_is_class": type(eng.connector) is cls,
                    "hit_tokens_cpu": eng.connector.stats()["sched_hit_tokens_cpu"], "block_size": BS,
                    "verified_blocks": eng.verified_blocks}
        finally:
            eng.close()


def sglang_backend() -> dict:
    """Our HiCache backend class, imported by SGLang's own loader of ``dynamic`` storage backends."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    found = _origin()
    cls = StorageBackendFactory._load_backend_class("tiered_kv.connector.sglang", "TieredHiCacheStorage", "tiered_kv")
    found.update(class_from_wheel=_from_venv(sys.modules[cls.__module__]), is_hicache=issubclass(cls, HiCacheStorage))
    return found


def main() -> int:
    """Dispatch ``argv[1]``; print the findings as one JSON line."""
    cmd, args = sys.argv[1], sys.argv[2:]
    found = {"requirements": unmet_requirements, "vllm": vllm_by_name, "sglang": sglang_backend}[cmd](*args)
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
