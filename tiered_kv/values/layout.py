"""Block layout: the shape and dtype of one KV block, and its fingerprint.

A block is the KV of ``block_size`` consecutive tokens across all layers. Below the
GPU a block is one contiguous run of ``nbytes`` bytes; ``BlockLayout`` says how to
view those bytes as a tensor and gives a fingerprint that goes into every key
namespace and every disk record, so bytes written for one layout are never read
back as another.

Threading contract: immutable values; safe from any thread. No torch import here
(the planner side must not need torch); ``torch_dtype()`` imports it lazily.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import xxhash

from tiered_kv.errors import ConfigError

#: dtype name -> bytes per element. fp8 types are stored as their raw bytes.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "uint8": 1, "int8": 1, "int16": 2, "int32": 4,
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
            "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def normalize_dtype(name: str) -> str:
    """Return the canonical dtype name for ``name`` ("bf16" -> "bfloat16", "torch.float16" -> "float16")."""
    if not isinstance(name, str):
        name = str(name)
    key = name.removeprefix("torch.").lower()
    key = _ALIASES.get(key, key)
    if key not in DTYPE_SIZES:
        raise ConfigError(f"dtype: unknown dtype {name!r}; valid: {sorted(DTYPE_SIZES)}")
    return key


@dataclass(frozen=True)
class BlockLayout:
    """Shape and dtype of one block, plus an optional tag for layout facts the shape does not show.

    ``tag`` carries e.g. "vllm:LBNHC" or "sglang:page_first" so two engines' byte orders
    with equal shapes still get different fingerprints.
    """

    shape: tuple[int, ...]
    dtype: str
    tag: str = ""

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if not shape or any((not isinstance(d, int)) or isinstance(d, bool) or d <= 0 for d in shape):
            raise ConfigError(f"block_shape: expected a non-empty list of positive ints, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        """Elements per block."""
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes per block."""
        return self.numel * self.itemsize

    @property
    def fingerprint(self) -> int:
        """A stable 64-bit fingerprint of shape, dtype and tag (same in every process and version)."""
        text = f"v1|{','.join(map(str, self.shape))}|{self.dtype}|{self.tag}"
        return xxhash.xxh3_64_intdigest(text.encode())

    def torch_dtype(self):  # -> torch.dtype; kept untyped so this module needs no torch
        """The torch dtype of this layout (imports torch)."""
        import torch

        return getattr(torch, self.dtype)

    def describe(self) -> str:
        """One line for logs and the CLI."""
        tag = f" [{self.tag}]" if self.tag else ""
        return f"{self.dtype}{list(self.shape)}{tag} = {self.nbytes} B/block (fp {self.fingerprint:016x})"
