"""Linux AIO range reads (``tiers.disk.aio``) on a real O_DIRECT file: bytes, order, errors, and no read left in
flight when the caller's callback fails."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from tiered_kv.tiers.cpu import aligned_empty
from tiered_kv.tiers.disk import SlotFile
from tiered_kv.tiers.disk.aio import AioReader, aio_available
from tiered_kv.tiers.disk.indexed import RangeReads
from tiered_kv.errors import RecordError
from tests.tiers.test_disk_slots import memory_mount
from tiered_kv.values.record import RecordHeader

pytestmark = pytest.mark.skipif(not aio_available(), reason="this kernel or sandbox refuses io_setup (the callers "
                                                            "then read with threads, tested in test_disk_slots.py)")
MIB = 1 << 20


def _opened_direct(path, nbytes: int, seed: int) -> tuple[int, np.ndarray]:
    """``nbytes`` of known bytes written to ``path``, opened with O_DIRECT: (fd, the bytes); skips where the file
    system refuses O_DIRECT (tmpfs before Linux 6.6)."""
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    with open(path, "wb") as fh:
        fh.write(data.tobytes())
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), data
    except OSError as exc:
        pytest.skip(f"no O_DIRECT on {os.path.dirname(path)}: {exc}")


@pytest.fixture()
def direct_file(tmp_path):
    """A 4 MiB file of known bytes opened with O_DIRECT (skips where the file system refuses O_DIRECT)."""
    fd, data = _opened_direct(tmp_path / "data.bin", 4 * MIB, 5)
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


@pytest.fixture()
def shm_direct_file():
    """32 MiB of known bytes in /dev/shm opened with O_DIRECT (skips without a tmpfs /dev/shm or where the kernel
    refuses O_DIRECT on tmpfs)."""
    if not os.path.isdir("/dev/shm") or not memory_mount("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    st = os.statvfs("/dev/shm")
    if st.f_bavail * st.f_frsize < 64 * MIB:  # a container's default /dev/shm is 64 MiB, often partly used
        pytest.skip(f"/dev/shm has {st.f_bavail * st.f_frsize // MIB} MiB free; the test writes 32 MiB")
    path = f"/dev/shm/tkv-test-aio-{os.getpid()}.bin"
    try:
        fd, data = _opened_direct(path, 32 * MIB, 7)
        yield fd, data
        os.close(fd)
    finally:
        if os.path.exists(path):
            os.remove(path)


def _traced(reader: AioReader, log: list) -> None:
    """Record each ``io_submit`` (its read count) in ``log`` in the order of the calls."""
    real = reader._syscall

    def syscall(nr, *args):
        if nr == reader._submit:
            log.append(("submit", args[1].value))
        return real(nr, *args)

    reader._syscall = syscall


@pytest.mark.parametrize("batch", [16, 128], ids=["batches-of-16", "one-submit-of-128"])
def test_on_tmpfs_the_first_read_lands_before_the_last_is_submitted(shm_direct_file, batch):
    """On tmpfs ``io_submit`` copies each read inside the call. 128 reads of 256 KiB in batches of 16: the first
    ``done`` comes right after the first submit (before the last submit, within the first half of the time: the
    best of 3 runs, a busy box may stall one). The old single submit of 128 (``submit_batch=128``) reports nothing
    until every read was copied."""
    fd, data = shm_direct_file
    kib256 = 256 << 10
    r = AioReader(depth=128, submit_batch=batch)
    events: list = []
    _traced(r, events)
    shares = []  # the first completion's time over the whole run's
    try:
        for _ in range(3):
            buf = aligned_empty(1, 32 * MIB)[0]
            reqs = [(fd, buf.data_ptr() + k * kib256, kib256, k * kib256) for k in range(128)]
            events.clear()
            times: list[float] = []

            def done(i: int, res: int) -> None:
                events.append(("done", res))
                times.append(time.perf_counter())

            t0 = time.perf_counter()
            r.run(reqs, done)
            shares.append((times[0] - t0) / (time.perf_counter() - t0))
            assert np.array_equal(buf.numpy(), data)
            assert [e for e in events if e[0] == "done"] == [("done", kib256)] * 128
            first_done = next(k for k, e in enumerate(events) if e[0] == "done")
            last_submit = max(k for k, e in enumerate(events) if e[0] == "submit")
            # the order of the calls does not depend on the box's speed
            assert (first_done < last_submit) == (batch == 16), events[:20]
            submits = [n for kind, n in events if kind == "submit"]
            assert sum(submits) == 128 and max(submits) == batch
    finally:
        r.close()
    if batch == 16:
        assert min(shares) < 0.5, shares
    else:  # the behaviour before batches: the first completion only after the whole batch was copied
        assert min(shares) > 0.5, shares


def test_a_real_disk_takes_the_reads_in_batches_and_lands_every_byte(direct_file):
    """On a file system where submits only queue the reads: submits that fill the depth (the reader's default), or
    of the batch a call asks for; every byte once either way."""
    fd, data = direct_file
    events: list = []
    r = AioReader(depth=32)
    _traced(r, events)
    try:
        for asked, most in ((None, 32), (4, 4)):
            buf = aligned_empty(1, 4 * MIB)[0]
            reqs = [(fd, buf.data_ptr() + k * 16384, 16384, k * 16384) for k in range(256)]
            seen: list[int] = []
            events.clear()
            r.run(reqs, lambda i, res: seen.append(i) if res == 16384 else None, submit_batch=asked)
            assert sorted(seen) == list(range(256)) and np.array_equal(buf.numpy(), data)
            sizes = [n for _, n in events]
            assert max(sizes) == most and len(sizes) >= 256 // most, sizes
    finally:
        r.close()


def test_a_submit_batch_below_one_is_refused_by_name():
    with pytest.raises(ValueError, match="submit_batch 0"):
        AioReader(depth=4, submit_batch=0)
    r = AioReader(depth=4)
    try:
        with pytest.raises(ValueError, match="submit_batch 0"):
            r.run([], lambda i, res: None, submit_batch=0)
    finally:
        r.close()
