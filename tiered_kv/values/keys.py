"""Keys: namespaced, fixed-length names for blocks.

Every key the store handles is ``namespace.prefix (8 bytes) + digest (24 bytes)``.
The namespace digests model, layout fingerprint and an optional tenant salt, so two
models, dtypes, layouts or tenants never share a key (DESIGN invariant 6), and a disk
tier can list or drop one namespace by prefix.

Two ways to make keys:
- ``Namespace.key(engine_hash)`` for engines that already hash their blocks (vLLM's
  ``request.block_hashes``, SGLang's page hashes): the engine bytes are re-hashed
  under the namespace.
- ``chain_keys(namespace, token_ids, page_size)`` for token-level callers: page-aligned
  chained hashes (block i's key depends on every token before it), so equal
  prefixes give equal keys.

Threading contract: pure functions and immutable values; safe from any thread.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from tiered_kv.errors import InvalidInputError

KEY_LEN = 32
PREFIX_LEN = 8


@dataclass(frozen=True)
class Namespace:
    """Where keys live: model + layout fingerprint + tenant salt (+ free-form extras such as a TP rank)."""

    model: str = ""
    layout_fingerprint: int = 0
    salt: str = ""
    extra: tuple[tuple[str, str], ...] = field(default=())

    @cached_property
    def prefix(self) -> bytes:
        """8-byte prefix shared by every key of this namespace (computed once)."""
        h = hashlib.blake2b(digest_size=PREFIX_LEN, person=b"tkv-ns-v1")
        h.update(self.model.encode())
        h.update(b"\0" + struct.pack("<Q", self.layout_fingerprint))
        h.update(b"\0" + self.salt.encode())
        for k, v in self.extra:
            h.update(b"\0" + k.encode() + b"=" + v.encode())
        return h.digest()

    def with_extra(self, **items: str) -> "Namespace":
        """A copy with more extras (e.g. ``ns.with_extra(tp_rank="0")``)."""
        merged = dict(self.extra)
        merged.update({k: str(v) for k, v in items.items()})
        return Namespace(self.model, self.layout_fingerprint, self.salt, tuple(sorted(merged.items())))

    @cached_property
    def _keyed(self) -> "hashlib._Hash":
        # a keyed hasher set up once and copied per key: about half the cost of a new keyed blake2b
        return hashlib.blake2b(digest_size=KEY_LEN - PREFIX_LEN, key=self.prefix)

    def key(self, engine_hash: bytes) -> bytes:
        """Namespaced key for an engine-provided block hash (any length of bytes).

        ``prefix + blake2b(engine_hash, key=prefix)``; cheap enough for vLLM's scheduler to call per block.
        """
        if not isinstance(engine_hash, (bytes, bytearray, memoryview)):
            raise InvalidInputError(f"engine hash must be bytes, got {type(engine_hash).__name__}")
        h = self._keyed.copy()
        h.update(engine_hash)
        return self.prefix + h.digest()

    def keys(self, engine_hashes: Sequence[bytes]) -> list[bytes]:
        """``[self.key(h) for h in engine_hashes]`` with the per-key attribute lookups hoisted (the vLLM
        scheduler names every new chunk of a prefill in one call)."""
        new, prefix = self._keyed.copy, self.prefix
        out: list[bytes] = []
        for h in engine_hashes:
            if not isinstance(h, (bytes, bytearray, memoryview)):
                raise InvalidInputError(f"engine hash must be bytes, got {type(h).__name__}")
            x = new()
            x.update(h)
            out.append(prefix + x.digest())
        return out


def chain_keys(namespace: Namespace, token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Keys for each full page of ``token_ids``; block i's key covers tokens ``[0, (i+1)*page_size)``.

    A trailing partial page gets no key (blocks are page-aligned).
    """
    if not isinstance(page_size, int) or page_size <= 0:
        raise InvalidInputError(f"page_size must be a positive int, got {page_size!r}")
    prefix = namespace.prefix
    keys: list[bytes] = []
    parent = prefix
    n_full = len(token_ids) // page_size
    for i in range(n_full):
        page = token_ids[i * page_size:(i + 1) * page_size]
        try:
            payload = struct.pack(f"<{page_size}q", *page)
        except struct.error as exc:
            raise InvalidInputError(f"token_ids[{i * page_size}:{(i + 1) * page_size}] must be ints: {exc}") from exc
        digest = hashlib.blake2b(parent + payload, digest_size=KEY_LEN - PREFIX_LEN, key=prefix).digest()
        parent = prefix + digest
        keys.append(parent)
    return keys


def check_key(key: object, what: str = "key") -> bytes:
    """Return ``key`` as bytes if it is a valid store key (bytes, 1..511 long), else raise InvalidInputError."""
    if isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    if not isinstance(key, bytes):
        raise InvalidInputError(f"{what} must be bytes, got {type(key).__name__} {key!r:.60}")
    if not 0 < len(key) <= 511:
        raise InvalidInputError(f"{what} must be 1..511 bytes long (LMDB's limit), got {len(key)} bytes")
    return key
