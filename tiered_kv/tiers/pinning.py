"""``HostPin``: page-lock (``cudaHostRegister``) one range of host memory in the background, and undo it.

Pinning a large range takes seconds (the driver faults in and locks every page: 8 GiB took 4.3 s on an
H200 host), so a tier that wants its host memory pinned starts it on a thread and goes on: copies work
before pinning ends, only slower. The range is registered as one piece by default: the driver refuses a
batched copy whose host range spans two registrations (seen on an H200 with 1 GiB chunks); ``chunk_bytes``
splits it for very large ranges whose copies never cross a chunk. The registration is *portable* (flag 1):
pinned for every device's context, so one process may copy to any of its GPUs.

Used by the private CPU slab (``cpu.py``) and the host pool (``pool/region.py``, a shared mapping each
process registers for itself). Without CUDA (or with ``pin`` False) it does nothing and reports 1.0.

Threading contract: the constructor starts the pinning thread; ``fraction`` and ``wait`` may be called from
any thread; ``close`` once, from the owner, after which the range is no longer registered.
"""
from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable


def want_pinning(pin: bool | None) -> bool:
    """Whether to pin: ``None`` means "when CUDA is present"; ``True`` still needs CUDA."""
    return torch.cuda.is_available() if pin is None else bool(pin and torch.cuda.is_available())


class HostPin:
    """Registers ``[base, base + nbytes)`` with CUDA on a background thread named ``thread_name``.

    ``what`` names the range in log lines ("cpu tier", "cpu pool host:a"). ``chunk_bytes`` None registers
    the whole range at once; a value splits it (at least 1 MiB per piece).
    """

    def __init__(self, base: int, nbytes: int, pin: bool | None, what: str, thread_name: str,
                 chunk_bytes: int | None = None) -> None:
        self.what = what
        self.nbytes = nbytes
        self.active = want_pinning(pin) and nbytes > 0
        self.pinned_bytes = 0
        self._registered: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.active:
            chunk = nbytes if chunk_bytes is None else max(chunk_bytes, 1 << 20)
            self._thread = threading.Thread(target=self._run, args=(base, chunk), name=thread_name, daemon=True)
            self._thread.start()

    @property
    def fraction(self) -> float:
        """Share of the range already page-locked (1.0 when no pinning is wanted or possible)."""
        if not self.active:
            return 1.0
        return self.pinned_bytes / self.nbytes

    def wait(self, timeout: float | None = None) -> bool:
        """Block until pinning ended; True if it did."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _run(self, base: int, chunk: int) -> None:
        cudart = torch.cuda.cudart()
        off = 0
        while off < self.nbytes and not self._stop.is_set():
            n = min(chunk, self.nbytes - off)
            err = cudart.cudaHostRegister(base + off, n, _PORTABLE)
            if int(err) != 0:
                log.warning("%s: pinning %d bytes at offset %d failed (cuda error %s); the rest stays pageable",
                            self.what, n, off, err)
                return
            self._registered.append(base + off)
            off += n
            self.pinned_bytes = off
        log.info("%s: pinned %.1f GiB", self.what, off / 2**30)

    def close(self) -> None:
        """Stop pinning and unregister what was pinned. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered.clear()
            self.pinned_bytes = 0
