"""Typed errors of the GPU <-> pinned CPU copy path.

Role: one place for the exceptions ``tiered_kv.copy`` raises. When the package's
``tiered_kv.errors`` module exists, misuse errors subclass its
``InvalidInputError`` (itself a ``ValueError``) and backend failures subclass its
``TieredKVError``; otherwise they fall back to ``ValueError`` / ``RuntimeError``
so callers can always catch the builtin base.

Threading: no state; safe from any thread.
"""

from __future__ import annotations

try:  # the lead's error hierarchy, when present
    from tiered_kv.errors import InvalidInputError as _InputBase
    from tiered_kv.errors import TieredKVError as _FailureBase
except ImportError:  # pragma: no cover - depends on what else is in the tree
    _InputBase = ValueError  # type: ignore[misc,assignment]
    _FailureBase = RuntimeError  # type: ignore[misc,assignment]


class LayoutError(_InputBase):  # type: ignore[misc,valid-type]
    """A KV tensor, slab or layout description is unusable (shape, stride, dtype, device)."""


class BlockIndexError(_InputBase):  # type: ignore[misc,valid-type]
    """Block ids or slot numbers passed to a copy are out of range, duplicated or mismatched."""


class BackendUnavailableError(_FailureBase):  # type: ignore[misc,valid-type]
    """A copy mechanism was requested that this process cannot run (no CUDA, no Triton, no cuda-python)."""


class CopyLaunchError(_FailureBase):  # type: ignore[misc,valid-type]
    """The CUDA driver or a kernel launch refused a copy; the message carries the driver's code."""
