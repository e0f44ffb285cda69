"""Linux native AIO for the disk tier's O_DIRECT range reads: many reads in flight from one thread.

Why: the overlapped in-step disk load (``connector/vllm/in_step_disk.py``) reads thousands of 256 KiB ranges
while vLLM's thread launches the forward. With one Python thread per read in flight, every finished read
must win the GIL back before its thread can issue the next one, and a thread that launches kernels in a
loop gives it up only every ``sys.getswitchinterval()`` (5 ms): on the 2-core CPU box, 32 reader threads
read 0.38-0.41 GB/s beside a busy Python thread against 0.77-0.89 GB/s without it; the same ranges through
``io_submit`` read 0.79-0.97 GB/s either way (2026-11-29, /tmp prototype, 256 MiB, page cache dropped). On
the H200 host the engine's overlapped reads ran at 0.56-0.70 GB/s while the same ranges read idle at
1.6-2.4 GB/s (docs/notes/2026-11-29-gpu-round4.md).

``AioReader.run(requests, done)`` submits the reads in order, keeps up to ``depth`` in flight and calls
``done(index, result)`` as each completes (``result``: bytes read, or ``-errno``). The GIL is held only
between system calls, once per batch of completions, not once per read. It goes through ``ctypes`` to the
``io_setup`` / ``io_submit`` / ``io_getevents`` / ``io_destroy`` system calls (no library: libaio is a thin
wrapper of the same calls); ctypes drops the GIL during each call but the non-blocking reap (below), which
returns at once. Buffered reads are synchronous in ``io_submit``, so callers use it only on O_DIRECT file
descriptors (``SlotFile.direct``), with 4 KiB-aligned buffers, offsets and sizes.

Submits go in batches of at most ``submit_batch`` reads (by default the depth: a submit fills what is free, the
behaviour before 2026-11-30; a call may ask for another size), with a
non-blocking reap (``io_getevents``, ``min_nr`` 0) between them, so completions that already landed reach
``done`` before the next batch goes in; ``run`` blocks for a completion only when it cannot submit more (all
submitted, or ``depth`` in flight). Why: on a memory file system (tmpfs, ramfs, on kernels that accept
O_DIRECT there) ``io_submit`` copies each read inside the call, so one submit of 128 reads returned only once
all 128 were copied and the first ``done`` came at the end: 2026-11-30, CPU box, 2 cores (kernel 6.18,
/dev/shm, 128 reads of 256 KiB), the first completion after 9.89 ms of 10.00 ms. In the engine, layer group 0
of a 33.5 MB chunk was ready only once the whole chunk was (the forward waited 14 ms: no overlap), and the
split, having learned a large overlap cost from that step, declined every later disk hit. On a real disk a
submit only queues its reads: smaller submits cost a few more system calls and the depth stays full.

The price of a batch: beside a thread running Python (vLLM's, launching an eager forward) this thread may wait
the switch interval (5 ms) for the GIL after each ``io_submit``. 2026-11-30, CPU box, 2 cores, 256 MiB of
256 KiB reads, one reader beside a spinning thread: from /dev/shm 0.64 GB/s in batches of 16 against 1.79 in
batches of 128, from the virtio disk 0.75 against 1.25 (idle: 3.9 against 3.8, and 1.1 against 1.0). So callers
pick the batch their completions need (the in-step disk load: one layer group's share of a lane's reads on a
memory file system, the whole depth on a disk). On a memory file system one thread also copies at one core's
speed (3.6 GB/s from /dev/shm idle on that box); callers that need more run several readers on several
threads (``connector/vllm/in_step_disk.py``'s AIO lanes).

``aio_available()`` says whether this kernel and process allow it (``io_setup`` works: not on macOS, not
under a seccomp filter that refuses it, not when ``/proc/sys/fs/aio-max-nr`` is used up); callers fall back
to threads otherwise.

Threading contract: one ``AioReader`` serves one thread at a time (its ``run`` calls must not overlap); several
readers may run on several threads at once (each its own AIO context); ``aio_available`` may be called from any
thread.
"""
from __future__ import annotations

import ctypes
import errno as errno_mod
import logging
import platform
import sys
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

#: (io_setup, io_destroy, io_getevents, io_submit) system call numbers by machine
_NR = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_IOCB_CMD_PREAD = 0


class _IOCB(ctypes.Structure):
    """``struct iocb`` (linux/aio_abi.h, little-endian)."""

    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    """``struct io_event``."""

    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


_lock = threading.Lock()
_available: bool | None = None


def _syscalls():
    """(syscall function that drops the GIL, one that keeps it, numbers) on Linux x86_64 / aarch64; None elsewhere."""
    nr = _NR.get(platform.machine())
    if not sys.platform.startswith("linux") or nr is None or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None  # the numbers and struct layouts below are the 64-bit ABI's
    fns = []
    for lib in (ctypes.CDLL(None, use_errno=True), ctypes.PyDLL(None, use_errno=True)):
        fn = lib.syscall
        fn.restype = ctypes.c_long
        fns.append(fn)
    return fns[0], fns[1], nr


def aio_available() -> bool:
    """Whether ``AioReader`` works here (tried once per process: an ``io_setup`` of one slot)."""
    global _available
    with _lock:
        if _available is None:
            try:
                AioReader(1).close()
                _available = True
            except OSError as exc:
                log.info("Linux AIO unavailable (%s): disk range reads use threads", exc)
                _available = False
        return _available


def _batch(submit_batch: int) -> int:
    """``submit_batch`` as an int, or ValueError naming it when below 1."""
    if submit_batch < 1:
        raise ValueError(f"AIO submit_batch {submit_batch} must be >= 1 (reads per io_submit)")
    return int(submit_batch)


class AioReader:
    """One AIO context of ``depth`` reads in flight, submitted ``submit_batch`` at a time (see the module)."""

    def __init__(self, depth: int = 128, submit_batch: int | None = None) -> None:
        """Raises OSError when the kernel refuses a context (``aio_available`` tells beforehand), ValueError for a
        ``depth`` or ``submit_batch`` below 1. ``submit_batch`` None: the depth (a submit fills what is free)."""
        sc = _syscalls()
        if sc is None:
            raise OSError(errno_mod.ENOSYS, f"Linux AIO needs Linux on x86_64 or aarch64, not {sys.platform} "
                                            f"{platform.machine()}")
        self._syscall, self._syscall_held, (self._setup, self._destroy, self._getevents, self._submit) = sc
        if depth < 1:
            raise ValueError(f"AIO depth {depth} must be >= 1")
        self.depth = int(depth)
        self.submit_batch = self.depth if submit_batch is None else _batch(submit_batch)
        self._ctx = ctypes.c_ulong(0)
        if self._syscall(self._setup, ctypes.c_uint(self.depth), ctypes.byref(self._ctx)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_setup({self.depth}) failed: {errno_mod.errorcode.get(err, err)} (a full "
                               "/proc/sys/fs/aio-max-nr, or a sandbox that refuses AIO)")
        self._events = (_Event * self.depth)()

    def run(self, requests: Sequence[tuple[int, int, int, int]], done: Callable[[int, int], None],
            submit_batch: int | None = None) -> None:
        """Read each ``(fd, buffer address, nbytes, file offset)`` in order, ``depth`` in flight at most,
        ``submit_batch`` per submit (None: the reader's); ``done(i, result)`` for request i once it completes
        (bytes read, or ``-errno``), on this thread. Returns when every read has completed, also when ``done`` or
        a submit raised (no read is left writing into a buffer after it returns)."""
        batch = self.submit_batch if submit_batch is None else _batch(submit_batch)
        n = len(requests)
        if n == 0:
            return
        iocbs = (_IOCB * n)()
        ptrs = (ctypes.POINTER(_IOCB) * n)()
        for i, (fd, addr, nbytes, off) in enumerate(requests):
            cb = iocbs[i]
            cb.data, cb.opcode, cb.fildes, cb.buf, cb.nbytes, cb.offset = i, _IOCB_CMD_PREAD, fd, addr, nbytes, off
            ptrs[i] = ctypes.pointer(cb)
        psize = ctypes.sizeof(ctypes.c_void_p)
        submitted = inflight = 0
        try:
            while submitted < n or inflight:
                refused = False  # EAGAIN: the kernel takes no more now; wait for a completion
                if submitted < n and inflight < self.depth:
                    k = min(batch, self.depth - inflight, n - submitted)
                    got = self._syscall(self._submit, self._ctx, ctypes.c_long(k),
                                        ctypes.byref(ptrs, submitted * psize))
                    if got <= 0:  # 0 never happens for k >= 1; taken as "try again" with reads in flight
                        err = ctypes.get_errno() if got < 0 else errno_mod.EAGAIN
                        if err != errno_mod.EAGAIN or not inflight:
                            raise OSError(err, f"io_submit: {errno_mod.errorcode.get(err, err)}")
                        refused = True
                    else:
                        submitted += got
                        inflight += got
                # inflight > 0 here: a submit took reads, or was refused with reads in flight (else it raised), or
                # none was tried (all submitted, or the depth full). More to submit now: take what already landed
                # without waiting; else wait for one
                more = not refused and submitted < n and inflight < self.depth
                got = self._reap(0 if more else 1)
                inflight -= got
                for e in self._events[:got]:
                    done(int(e.data), int(e.res))
        finally:
            try:
                while inflight:  # never leave a read in flight into memory the caller may reuse
                    inflight -= self._reap(1)
            except OSError:  # io_getevents itself failed: io_destroy waits for the reads; this reader is done
                self.close()
                raise

    def _reap(self, at_least: int) -> int:
        """Wait (without the GIL) for ``at_least`` completions; returns how many landed in ``_events``. 0: take what
        landed, no wait, and keep the GIL for it: beside a thread running Python, every time this thread wants the
        GIL back it may wait its switch interval (5 ms), once per submit already."""
        call = self._syscall if at_least else self._syscall_held
        while True:
            got = call(self._getevents, self._ctx, ctypes.c_long(at_least), ctypes.c_long(self.depth),
                                self._events, None)
            if got >= 0:
                return int(got)
            err = ctypes.get_errno()
            if err != errno_mod.EINTR:
                raise OSError(err, f"io_getevents: {errno_mod.errorcode.get(err, err)}")

    def close(self) -> None:
        """Destroy the context (after the last ``run``; the kernel waits for reads still in flight). Idempotent."""
        if self._ctx.value:
            self._syscall(self._destroy, self._ctx)
            self._ctx = ctypes.c_ulong(0)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
