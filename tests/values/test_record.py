"""The on-disk record header: round trip, and tampering is detected."""
from __future__ import annotations

import pytest

from tiered_kv.errors import RecordError
from tiered_kv.values.record import HEADER_LEN, RecordHeader


def K(i: int) -> bytes:
    """A 32-byte key for block number ``i``."""
    return i.to_bytes(4, "little") * 8


def test_record_header_roundtrip_and_tamper():
    h = RecordHeader(0, 42, 3, 100, 100, 12345)
    raw = h.pack(K(1))
    assert len(raw) == HEADER_LEN
    back = RecordHeader.unpack(K(1), raw)
    assert (back.slot, back.raw_len, back.payload_xxh, back.layout_fp) == (3, 100, 12345, 42)
    with pytest.raises(RecordError):
        RecordHeader.unpack(K(2), raw)  # moved to another key
    flipped = bytearray(raw)
    flipped[20] ^= 1
    with pytest.raises(RecordError):
        RecordHeader.unpack(K(1), bytes(flipped))
