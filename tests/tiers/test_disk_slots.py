"""``SlotFile`` on its own: one block in, one block out, verified against the header it returned."""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tiered_kv.errors import RecordError
from tiered_kv.tiers.disk import ALIGN, SlotFile
from tiered_kv.tiers.disk.slots import file_system_type
from tiered_kv.values.record import CODEC_NONE, CODEC_ZSTD, RecordHeader, payload_checksum

NBYTES = 6000  # not a page multiple: exercises the bounce buffer under O_DIRECT
SLOT = 8192
FP = 0xABC


def _block(seed: int, compressible: bool = False, nbytes: int = NBYTES) -> np.ndarray:
    if compressible:
        return np.full(nbytes, seed % 251, dtype=np.uint8)
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.fixture(params=[(True, CODEC_NONE), (False, CODEC_NONE), (True, CODEC_ZSTD)],
                ids=["direct", "buffered", "direct-zstd"])
def slot_file(request, tmp_path):
    direct_io, codec = request.param
    f = SlotFile(tmp_path / "payload.bin", SLOT, direct_io=direct_io, codec=codec)
    f.ensure_slots(4)
    yield f
    f.close()


def test_size_in_slots_only_grows(slot_file):
    assert slot_file.slot_count() == 4
    slot_file.ensure_slots(2)
    assert slot_file.slot_count() == 4
    slot_file.ensure_slots(6)
    assert slot_file.slot_count() == 6


def _page_aligned(n: int, offset: int = 0) -> np.ndarray:
    """``n`` bytes of page-aligned memory (an anonymous mmap), or ``offset`` bytes past a page boundary."""
    return np.frombuffer(mmap.mmap(-1, n + ALIGN), dtype=np.uint8)[offset:offset + n]


@pytest.mark.parametrize("nbytes", [NBYTES, SLOT], ids=["partial-page", "whole-pages"])
@pytest.mark.parametrize("compressible", [False, True])
def test_round_trip_from_and_into_any_memory(slot_file, compressible, nbytes):
    """Aligned whole-page rows go straight to the file; anything else through the bounce buffer."""
    blocks = {}
    for slot in range(4):
        raw = _block(slot, compressible, nbytes)
        blocks[slot] = raw if slot % 2 else _page_aligned(nbytes)
        blocks[slot][:] = raw
    headers = {slot: slot_file.write(slot, raw, FP) for slot, raw in blocks.items()}
    for slot, hdr in headers.items():
        assert (hdr.slot, hdr.layout_fp, hdr.raw_len) == (slot, FP, nbytes)
        zstd_kept = slot_file.codec == CODEC_ZSTD and compressible
        assert hdr.codec == (CODEC_ZSTD if zstd_kept else CODEC_NONE)  # zstd kept only when it is smaller
        assert (hdr.payload_len < nbytes) == zstd_kept
    for slot, hdr in headers.items():
        for dst in (_page_aligned(nbytes), _page_aligned(nbytes, offset=1), np.empty(nbytes, dtype=np.uint8)):
            dst[:] = 0
            slot_file.read(hdr, torch.from_numpy(dst))
            assert dst.tobytes() == blocks[slot].tobytes()


def test_damaged_payload_is_a_record_error(slot_file, tmp_path):
    raw = _block(1, compressible=True)
    hdr = slot_file.write(2, raw, FP)
    with open(tmp_path / "payload.bin", "r+b") as f:
        f.seek(2 * SLOT + 3)
        f.write(b"\xff\xfe")
    with pytest.raises(RecordError, match="checksum"):
        slot_file.read(hdr, torch.empty(NBYTES, dtype=torch.uint8))
    too_long = RecordHeader(hdr.codec, FP, 2, NBYTES, SLOT + 1, hdr.payload_xxh)
    with pytest.raises(RecordError, match="does not fit"):
        slot_file.read(too_long, torch.empty(NBYTES, dtype=torch.uint8))


def test_an_undecodable_zstd_frame_with_a_matching_checksum_is_a_record_error(tmp_path):
    f = SlotFile(tmp_path / "payload.bin", SLOT, codec=CODEC_ZSTD)
    try:
        f.ensure_slots(1)
        garbage = np.frombuffer(b"not a zstd frame" * 8, dtype=np.uint8)
        f._pwrite(garbage, 0)
        hdr = RecordHeader(CODEC_ZSTD, FP, 0, NBYTES, garbage.nbytes, payload_checksum(garbage))
        with pytest.raises(RecordError, match="zstd"):
            f.read(hdr, torch.empty(NBYTES, dtype=torch.uint8))
    finally:
        f.close()


# ---------------------------------------------------------------------------------------------- reads by range

@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
def test_a_record_read_by_ranges_in_any_order_is_the_record(tmp_path, direct_io):
    """The in-step disk load reads a record layer group by layer group (ranges of every block, out of order):
    the image is the record once every range is in, whatever the alignment (O_DIRECT rounds each range out to
    4 KiB); ``verify`` says so, and says no once a byte of the payload changed on disk."""
    nbytes = 4 * 4096
    f = SlotFile(tmp_path / "payload.bin", nbytes, direct_io=direct_io)
    f.ensure_slots(2)
    raw = _block(7, nbytes=nbytes)
    hdr = f.write(1, raw, FP)
    image = torch.zeros(nbytes, dtype=torch.uint8)
    for a, b in [(9000, 12288), (0, 100), (4096, 9000), (100, 4096), (12288, nbytes)]:
        f.read_range(hdr, a, b, image)
    assert np.array_equal(image.numpy(), raw) and f.verify(hdr, image)
    part = torch.zeros(nbytes, dtype=torch.uint8)
    f.read_range(hdr, 5000, 6000, part)
    assert np.array_equal(part.numpy()[5000:6000], raw[5000:6000])  # at least the range; O_DIRECT reads around it
    with pytest.raises(RecordError, match="outside"):
        f.read_range(hdr, 0, nbytes + 1, image)
    with open(tmp_path / "payload.bin", "r+b") as fh:  # a byte of the payload changes under the header
        fh.seek(nbytes + 5)
        fh.write(bytes([(int(raw[5]) + 1) % 256]))
    again = torch.zeros(nbytes, dtype=torch.uint8)
    f.read_range(hdr, 0, nbytes, again)
    assert not f.verify(hdr, again)
    f.close()


def test_a_compressed_record_is_not_read_by_range(tmp_path):
    f = SlotFile(tmp_path / "payload.bin", SLOT, codec=CODEC_ZSTD)
    f.ensure_slots(1)
    hdr = f.write(0, _block(3, compressible=True), FP)
    assert hdr.codec == CODEC_ZSTD
    with pytest.raises(RecordError, match="compressed"):
        f.read_range(hdr, 0, 10, torch.zeros(NBYTES, dtype=torch.uint8))
    f.close()


def memory_mount(path: str) -> bool:
    """Whether ``path`` is on tmpfs or ramfs by ``/proc/mounts`` (its longest mount point): the tests' own reading,
    independent of ``SlotFile``'s (``/proc/self/mountinfo`` by device number)."""
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            mounts = [line.split() for line in fh]
    except OSError:
        return False
    real = os.path.realpath(path)
    best = max((m for m in mounts if len(m) > 2 and (real == m[1] or real.startswith(m[1].rstrip("/") + "/"))),
               key=lambda m: len(m[1]), default=None)
    return best is not None and best[2] in ("tmpfs", "ramfs")


def test_a_file_in_memory_is_told_from_one_on_disk(tmp_path):
    """``memory_fs``: True for a payload file under /dev/shm (tmpfs by /proc/mounts), False under a directory on a
    disk; O_DIRECT is used or not as before either way (``direct`` follows only what the kernel accepts)."""
    cases = []
    if os.path.isdir("/dev/shm") and memory_mount("/dev/shm"):
        cases.append((f"/dev/shm/tkv-test-slots-{os.getpid()}.bin", True))
    if not memory_mount(str(tmp_path)):
        cases.append((str(tmp_path / "payload.bin"), False))
    if not cases:
        pytest.skip("neither a tmpfs /dev/shm nor a temporary directory on a disk here")
    for path, in_memory in cases:
        try:
            f = SlotFile(Path(path), SLOT)
            try:
                assert f.memory_fs is in_memory, path
                try:  # O_DIRECT wherever the kernel takes it, in memory or not
                    os.close(os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
                    assert f.direct == bool(getattr(os, "O_DIRECT", 0)), path
                except OSError:
                    assert not f.direct, path
                f.ensure_slots(1)
                hdr = f.write(0, _block(3, nbytes=SLOT), FP)
                out = torch.empty(SLOT, dtype=torch.uint8)
                f.read(hdr, out)
                assert np.array_equal(out.numpy(), _block(3, nbytes=SLOT))
            finally:
                f.close()
        finally:
            Path(path).unlink(missing_ok=True)


def test_file_system_type_says_none_when_it_cannot_tell():
    assert file_system_type(-1) is None  # not an open descriptor
