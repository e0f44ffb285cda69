"""On-disk record header: the small, versioned, checksummed description of one stored block.

A disk record is this header (kept in the LMDB index under the block's key) plus a
payload (kept in a fixed-size slot of the payload file). The header is parsed with
``struct`` only: nothing read back from storage is ever unpickled or evaluated
(DESIGN invariant 4). Two checksums guard a record: one over the header (and the key
it is stored under), one over the payload.

Layout (little-endian, 64 bytes):
``magic 4s | version H | codec B | flags B | layout_fp Q | slot Q | raw_len Q |
payload_len Q | payload_xxh Q | created_ns Q | header_xxh Q``

Threading contract: pure functions and immutable values; safe from any thread.
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import xxhash

from tiered_kv.errors import RecordError

MAGIC = b"TKV1"
VERSION = 1
CODEC_NONE = 0
CODEC_ZSTD = 1
CODECS = {"none": CODEC_NONE, "zstd": CODEC_ZSTD}
_FMT = struct.Struct("<4sHBBQQQQQQQ")
HEADER_LEN = _FMT.size


def payload_checksum(data) -> int:
    """64-bit checksum of a payload (any buffer)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """Parsed header of one disk record."""

    codec: int
    layout_fp: int
    slot: int
    raw_len: int
    payload_len: int
    payload_xxh: int
    created_ns: int = 0

    def payload_matches(self, data) -> bool:
        """Whether ``data`` (any buffer of at least ``payload_len`` bytes) starts with the payload this header
        describes: its length-``payload_len`` prefix has the header's checksum."""
        return payload_checksum(memoryview(data).cast("B")[:self.payload_len]) == self.payload_xxh

    def pack(self, key: bytes) -> bytes:
        """Serialize; the header checksum also covers ``key`` so a header moved to another key fails."""
        body = _FMT.pack(MAGIC, VERSION, self.codec, 0, self.layout_fp, self.slot, self.raw_len,
                         self.payload_len, self.payload_xxh, self.created_ns or time.time_ns(), 0)
        return body[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(key + body[:-8]))

    @classmethod
    def unpack(cls, key: bytes, data: bytes) -> "RecordHeader":
        """Parse and verify; raises RecordError for anything but a well-formed header of this key."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise RecordError(f"record header must be bytes, got {type(data).__name__}")
        if len(data) != HEADER_LEN:
            raise RecordError(f"record header must be {HEADER_LEN} bytes, got {len(data)}")
        data = bytes(data)
        (magic, version, codec, _flags, layout_fp, slot, raw_len, payload_len, payload_xxh, created,
         hxh) = _FMT.unpack(data)
        if magic != MAGIC:
            raise RecordError(f"bad magic {magic!r}")
        if version != VERSION:
            raise RecordError(f"unsupported record version {version}")
        if hxh != xxhash.xxh3_64_intdigest(key + data[:-8]):
            raise RecordError("header checksum mismatch")
        if codec not in CODECS.values():
            raise RecordError(f"unknown codec {codec}")
        if payload_len > raw_len and codec == CODEC_NONE or payload_len == 0:
            raise RecordError(f"inconsistent lengths raw={raw_len} payload={payload_len}")
        return cls(codec, layout_fp, slot, raw_len, payload_len, payload_xxh, created)
