"""Import-only stand-in for FlashInfer in tiered_kv's SGLang GPU recipe (scripts/gpu/sglang/).

SGLang 0.5.17's sampler imports ``flashinfer.sampling`` on every CUDA machine, even with
``--sampling-backend pytorch``; the GPU machine has no FlashInfer and no network, and the real
package pulls in ~1 GB of CUTLASS DSL and cubins. ``install_on_gpu.sh`` installs this stand-in only
when ``import flashinfer`` fails, and the benchmark sets ``SGLANG_IS_FLASHINFER_AVAILABLE=false``
so SGLang never selects a FlashInfer code path. Any call into it raises with that explanation.
"""
__version__ = "0.0.0+tiered-kv-shim"


class _Unavailable:
    """A FlashInfer name that was imported but must never be called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"flashinfer.{self._name}: FlashInfer is not installed (tiered_kv GPU recipe shim); "
                           f"run SGLang with --sampling-backend pytorch --attention-backend triton")

    def __getattr__(self, item: str) -> "_Unavailable":
        return _Unavailable(f"{self._name}.{item}")


def __getattr__(name: str) -> _Unavailable:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(name)
