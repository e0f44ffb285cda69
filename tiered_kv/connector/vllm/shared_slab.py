"""One CPU slab in POSIX shared memory for every TP rank of an engine: MLA KV stored once.

An MLA model's latent KV is the same on every tensor-parallel rank (vLLM replicates its KV
projection), so a replicated cache keeps one copy for all ranks instead of one per rank.
``SharedSlab`` is that copy's host memory: rank 0 creates ``/dev/shm/<name>`` (sized, then
renamed into place, so no rank maps a half-made file), the other ranks wait for it and map the
same pages, and every rank pins its own mapping for DMA. Once every rank has mapped it, rank 0
unlinks the name (``release_name``), so the memory goes back to the system when the last
process exits, even after a crash. Which rank copies what is the worker's business
(``worker.py``: rank 0 writes, every rank reads).

Threading contract: construct, ``release_name`` and ``close`` on the worker thread; the
pinning thread only registers memory, never reads or writes rows.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time

import torch

from tiered_kv.errors import ConfigError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
#: How long a rank waits for rank 0 to create the region (rank 0 may still be loading weights).
OPEN_TIMEOUT_S = 600.0


class SharedSlab:
    """A ``(capacity, row_bytes)`` uint8 slab in shared memory, mapped by ``tp`` ranks of one engine."""

    def __init__(self, name: str, capacity: int, row_bytes: int, rank: int, tp: int, pin: bool | None = None,
                 timeout: float = OPEN_TIMEOUT_S) -> None:
        if "/" in name or not name:
            raise ConfigError(f"shared slab name {name!r} must be a plain file name")
        self.capacity, self.rank, self.tp = capacity, rank, tp
        self.path = os.path.join(SHM_DIR, name)
        nbytes = capacity * row_bytes
        if rank == 0:
            fd = self._create(nbytes)
        else:
            fd = self._open(nbytes, timeout)
        try:
            self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if rank != 0:  # tell rank 0 this rank holds a mapping (the name may go once every rank does)
            open(f"{self.path}.mapped{rank}", "w").close()
        self.slab = torch.frombuffer(self._mm, dtype=torch.uint8).view(capacity, row_bytes)
        self._released = False
        self._registered = 0
        self._pin = torch.cuda.is_available() if pin is None else bool(pin and torch.cuda.is_available())
        self._thread: threading.Thread | None = None
        if self._pin:
            self._thread = threading.Thread(target=self._register, name="tkv-shm-pin", daemon=True)
            self._thread.start()
        log.info("TieredKVConnector rank %d: shared CPU slab %s, %.2f GiB, %d chunk slots", rank, self.path,
                 nbytes / 2**30, capacity)

    def _create(self, nbytes: int) -> int:
        st = os.statvfs(SHM_DIR)
        if st.f_bavail * st.f_frsize < nbytes:
            raise ConfigError(f"TieredKVConnector: {SHM_DIR} has {st.f_bavail * st.f_frsize} bytes free, the shared "
                              f"MLA slab needs {nbytes} (cpu_bytes): enlarge {SHM_DIR} (docker: --shm-size), lower "
                              f"cpu_bytes, or set mla_store_once false")
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.ftruncate(fd, nbytes)
            os.rename(tmp, self.path)  # appears complete or not at all
        except OSError:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd

    def _open(self, nbytes: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
                break
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise ConfigError(f"TieredKVConnector rank {self.rank}: rank 0 did not create the shared MLA "
                                      f"slab {self.path} within {timeout:.0f} s (are all TP ranks on one host?); "
                                      f"set mla_store_once false") from None
                time.sleep(0.01)
        size = os.fstat(fd).st_size
        if size != nbytes:
            os.close(fd)
            raise ConfigError(f"TieredKVConnector rank {self.rank}: shared slab {self.path} is {size} bytes, "
                              f"expected {nbytes}: the ranks disagree on the geometry")
        return fd

    def _register(self) -> None:
        nbytes = self.slab.numel()
        err = torch.cuda.cudart().cudaHostRegister(self.slab.data_ptr(), nbytes, 1)  # 1 = portable
        if int(err) != 0:
            log.warning("shared slab %s: pinning failed (cuda error %s); copies stay pageable", self.path, err)
            return
        self._registered = nbytes

    @property
    def pinned_fraction(self) -> float:
        """1.0 once the mapping is page-locked (or no pinning is wanted)."""
        return 1.0 if not self._pin else self._registered / max(1, self.slab.numel())

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Block until pinning ended; True if it did."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def release_name(self) -> bool:
        """Rank 0: unlink the name once every rank has mapped the region (True when done)."""
        if self._released or self.rank != 0:
            return True
        markers = [f"{self.path}.mapped{r}" for r in range(1, self.tp)]
        if not all(os.path.exists(m) for m in markers):
            return False
        for p in [self.path, *markers]:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        self._released = True
        return True

    def close(self) -> None:
        """Unpin and unmap; rank 0 also removes the name if it is still there."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.slab.data_ptr())
            self._registered = 0
        if self.rank == 0 and not self._released:
            for p in [self.path] + [f"{self.path}.mapped{r}" for r in range(1, self.tp)]:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            self._released = True
        self.slab = None
        try:
            self._mm.close()
        except BufferError:  # views of it still alive elsewhere: the mapping goes with them
            pass
