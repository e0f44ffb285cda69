"""Typed errors raised by tiered_kv.

Role: one small hierarchy so callers (and the connectors) can catch what we raise
without catching everything. Capacity is never an error (a full tier refuses a put
with a return value); misuse and bad configuration are.

Threading contract: plain exception classes, safe everywhere.
"""
from __future__ import annotations


class TieredKVError(Exception):
    """Base class of every error tiered_kv raises on purpose."""


class ConfigError(TieredKVError, ValueError):
    """A configuration value is unknown, malformed or out of range. The message names it."""


class InvalidInputError(TieredKVError, ValueError):
    """An argument to a public call is wrong (dtype, shape, device, lengths). The message names it."""


class StoreClosedError(TieredKVError, RuntimeError):
    """The store (or tier) was closed; open a new one."""


class RecordError(TieredKVError):
    """A stored record failed to parse or verify. Internal: the store turns it into a miss."""


class TransferTimeout(TieredKVError, TimeoutError):
    """A handle's wait() ran past its timeout; the transfer keeps running."""


class DamagedIndexError(ConfigError):
    """A disk tier's LMDB index failed its integrity check. ``path`` names the directory, ``reason`` the
    finding; ``TieredStore`` moves such a directory aside and runs without its disk tier."""

    def __init__(self, message: str, path: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason


class RemoteUnavailableError(TieredKVError, ConnectionError):
    """The remote tier's cluster could not be reached at start-up (later failures are misses, never this)."""
