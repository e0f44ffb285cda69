"""Stand-in for ``flashinfer.prefill`` (see the package docstring): names import, calls raise."""
from flashinfer import _Unavailable


def __getattr__(name: str) -> _Unavailable:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable("prefill." + name)
