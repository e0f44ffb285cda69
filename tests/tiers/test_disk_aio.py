"""Linux AIO range reads (``tiers.disk.aio``) on a real O_DIRECT file: bytes, order, errors, and no read left in
flight when the caller's callback fails."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tiered_kv.tiers.cpu import aligned_empty
from tiered_kv.tiers.disk import SlotFile
from tiered_kv.tiers.disk.aio import AioReader, aio_available
from tiered_kv.tiers.disk.indexed import RangeReads
from tiered_kv.errors import RecordError
from tiered_kv.values.record import RecordHeader

pytestmark = pytest.mark.skipif(not aio_available(), reason="this kernel or sandbox refuses io_setup (the callers "
                                                            "then read with threads, tested in test_disk_slots.py)")
MIB = 1 << 20


@pytest.fixture()
def direct_file(tmp_path):
    """A 4 MiB file of known bytes opened with O_DIRECT (skips where the file system refuses O_DIRECT)."""
    data = np.random.default_rng(5).integers(0, 256, 4 * MIB, dtype=np.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        pytest.skip(f"no O_DIRECT on {tmp_path}: {exc}")
    yield fd, data
    os.close(fd)


def test_many_ranges_with_few_in_flight_land_every_byte_once(direct_file):
    """200 ranges of 16 KiB, 8 in flight, in a scattered order: each reported once with its size, and the buffer
    holds the file's bytes at each range."""
    fd, data = direct_file
    buf = aligned_empty(1, 4 * MIB)[0]
    order = np.random.default_rng(1).permutation(256)[:200]
    reqs = [(fd, buf.data_ptr() + int(k) * 16384, 16384, int(k) * 16384) for k in order]
    seen: list[tuple[int, int]] = []
    r = AioReader(depth=8)
    try:
        r.run(reqs, lambda i, res: seen.append((i, res)))
        r.run([], lambda i, res: seen.append((i, res)))  # nothing to read: nothing reported
    finally:
        r.close()
        r.close()  # idempotent
    assert sorted(i for i, _ in seen) == list(range(200)) and all(res == 16384 for _, res in seen)
    got = buf.numpy()
    for k in order:
        a = int(k) * 16384
        assert np.array_equal(got[a:a + 16384], data[a:a + 16384])


def test_a_read_past_the_end_is_short_and_a_bad_descriptor_names_the_call(direct_file):
    fd, _ = direct_file
    buf = aligned_empty(1, MIB)[0]
    results = {}
    with_reader = AioReader(depth=4)
    try:
        with_reader.run([(fd, buf.data_ptr(), 8192, 4 * MIB - 4096), (fd, buf.data_ptr() + 8192, 4096, 8 * MIB)],
                        results.__setitem__)
        assert results == {0: 4096, 1: 0}  # half of it, then nothing: the caller's check sees short reads
        with pytest.raises(OSError, match="io_submit"):
            with_reader.run([(10**6, buf.data_ptr(), 4096, 0)], results.__setitem__)
    finally:
        with_reader.close()
    with pytest.raises(ValueError, match="depth 0"):
        AioReader(depth=0)


def test_a_failing_callback_returns_only_once_no_read_is_in_flight(direct_file):
    """``done`` raises at the first completion: ``run`` raises it, but only after every submitted read ended (none
    left writing into memory the caller may free); the reader still works afterwards."""
    fd, data = direct_file
    buf = aligned_empty(1, 4 * MIB)[0]
    reqs = [(fd, buf.data_ptr() + k * 65536, 65536, k * 65536) for k in range(64)]

    def boom(i: int, res: int) -> None:
        raise RuntimeError("callback failed")

    r = AioReader(depth=32)
    try:
        with pytest.raises(RuntimeError, match="callback failed"):
            r.run(reqs, boom)
        seen = []
        r.run(reqs[:4], lambda i, res: seen.append(res))
        assert seen == [65536] * 4
    finally:
        r.close()
    assert np.array_equal(buf.numpy()[:4 * 65536], data[:4 * 65536])


def test_range_reads_by_aio_make_the_record_and_a_short_read_marks_it_damaged(tmp_path):
    """``RangeReads.requests`` / ``landed`` (the in-step disk load's AIO path) over a real ``DiskTier``-style
    slot file: the record read by ranges through AIO verifies; a short result marks it damaged."""
    nbytes = 8 * 4096
    f = SlotFile(tmp_path / "payload.bin", nbytes, direct_io=True)
    if not f.direct:
        f.close()
        pytest.skip("no O_DIRECT here")
    f.ensure_slots(2)
    raw = np.random.default_rng(9).integers(0, 256, nbytes, dtype=np.uint8)
    hdr = f.write(1, raw, 0xABC)
    image = aligned_empty(1, nbytes)[0]
    reqs = [f.range_request(hdr, a, b, image) for a, b in [(0, 5000), (5000, 20000), (20000, nbytes)]]
    assert all(q is not None for q in reqs)
    unaligned = torch.zeros(nbytes + 1, dtype=torch.uint8)[1:]
    assert f.range_request(hdr, 0, 4096, unaligned) is None  # not page-aligned: the caller reads it another way
    with pytest.raises(RecordError, match="past the"):  # the kernel would write past a row too short for the record
        f.range_request(hdr, 0, nbytes, aligned_empty(1, 4096)[0])
    r = AioReader(depth=2)
    try:
        r.run(reqs, lambda i, res: None)
    finally:
        r.close()
    assert np.array_equal(image.numpy(), raw) and f.verify(hdr, image)

    class _Tier:  # RangeReads needs only ``header`` and ``slots`` from its tier here
        slots = f

        @staticmethod
        def header(key, blob):
            return RecordHeader.unpack(key, blob)

    reads = RangeReads(_Tier(), [b"k"], [None], [])
    assert reads.requests(0, [(0, 4096)], image) == []  # no record: nothing to read
    reads.headers[0] = hdr
    assert reads.requests(0, [(0, 4096)], unaligned) is None
    assert reads.landed(0, 4096, 4096) and not reads.corrupt(0)
    assert not reads.landed(0, -5, 4096) and reads.corrupt(0)
    f.close()
