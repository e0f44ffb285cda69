"""Where a host pool lives, who may open it, and when it is made or removed.

A pool named ``<name>`` is the directory ``<shm_dir>/tiered_kv-<uid>/<name>/`` (``shm_dir`` is
``/dev/shm``: memory, gone at reboot)::

    tiered_kv-<uid>/            0700, owned by the user: no other user can see, open or plant anything
        <name>/                 0700
            pool.json           the geometry (slot size, slots), written last: a pool without it is unfinished
            payload             0600, ``slots * slot_bytes`` bytes reserved at creation (posix_fallocate)
            index/              0600 files: the LMDB index (records, free slots, claims, budget, leases)

Every open, creation and removal happens under one lock, an ``flock`` on the user's directory (and a
thread lock, since an ``flock`` is per open file), so these steps never interleave between processes:

- **open**: an existing pool is *live* while some process has its index open (LMDB holds a lock on
  ``index/lock.mdb`` for as long as a process has the environment open; ``index_users`` reads them from
  ``/proc/locks``). A pool with no live user (every user crashed, or a creator died half way) is removed
  and made anew: a pool is volatile, a cache of what its processes computed. A live pool is joined
  after checking its geometry against the joiner's: a different slot size or slot count is a
  ``ConfigError`` naming both (``cpu_bytes`` and the block shape must be the same in every process).
  The opener opens its index before the lock is let go, so it is a user from then on.
- **close**: the last user to close removes the pool, so its memory goes back at once; a pool whose
  users all died is removed by the next open of its name (until then its memory stays in ``/dev/shm``).
- When ``/proc/locks`` cannot be read (not Linux) a pool is never taken for dead: it is joined, and
  removed only by hand.

Every process of one pool must see the others' pids (one PID namespace): claims and leases of a dead
pid are returned by checking that the pid is gone, as in a shared disk directory.

Threading contract: every function may be called from any thread; ``pool_lock`` serializes the critical
sections of every thread and process of this user.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tiered_kv.errors import ConfigError
from tiered_kv.tiers.disk.tier import index_users

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SCHEME = "host:"
FORMAT = 1
GEOMETRY = "pool.json"
PAYLOAD = "payload"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_THREAD_LOCK = threading.Lock()


def pool_name(spec: object) -> str:
    """The pool name in a ``cpu_pool`` value ``"host:<name>"``; ConfigError naming the value otherwise."""
    if not isinstance(spec, str) or not spec.startswith(SCHEME) or not _NAME.fullmatch(spec[len(SCHEME):]):
        raise ConfigError(f"cpu_pool: expected \"host:<name>\" with a name of 1-64 letters, digits, '.', '_' or "
                          f"'-' (not starting with '.', '_' or '-'), got {spec!r}")
    return spec[len(SCHEME):]


def check_pool_size(spec: object, cpu_bytes: int) -> None:
    """A ``cpu_pool`` value (None: no pool) and the ``cpu_bytes`` that sizes it: a valid name and a size above 0;
    ConfigError naming the bad key otherwise (the stores' and the SGLang backend's one check)."""
    if spec is None:
        return
    pool_name(spec)
    if cpu_bytes == 0:
        raise ConfigError(f"cpu_pool={spec!r} needs cpu_bytes > 0: the pool's size (the same in every process of "
                          f"the pool)")


@dataclass(frozen=True)
class Geometry:
    """What every process of a pool must agree on: bytes per slot and slots."""

    slot_bytes: int
    slots: int

    @property
    def nbytes(self) -> int:
        """Bytes of the payload."""
        return self.slot_bytes * self.slots


def user_root(shm_dir: str | os.PathLike = SHM_DIR) -> Path:
    """``<shm_dir>/tiered_kv-<uid>``, made 0700 if absent; ConfigError when it is not a private directory of
    this user (a symlink, another owner, wider permissions): someone else could read or plant pools there."""
    root = Path(shm_dir) / f"tiered_kv-{os.getuid()}"
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cpu_pool: cannot create {str(root)!r} ({exc}); is {str(shm_dir)!r} a writable "
                          f"tmpfs?") from None
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        raise ConfigError(f"cpu_pool: {str(root)!r} must be a directory of uid {os.getuid()} with mode 0700 (found "
                          f"{'a symlink' if stat.S_ISLNK(st.st_mode) else f'uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}'}"
                          f"); remove it so it is made anew")
    return root


@contextlib.contextmanager
def pool_lock(root: Path) -> Iterator[None]:
    """Hold the lock every open, creation and removal of this user's pools takes."""
    with _THREAD_LOCK:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # drops the flock


def read_geometry(path: Path) -> Geometry | None:
    """The geometry a finished pool records (None: unfinished, or not a pool)."""
    try:
        fmt = json.loads((path / GEOMETRY).read_text())
        if fmt.get("format") != FORMAT:
            return None
        return Geometry(int(fmt["slot_bytes"]), int(fmt["slots"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_geometry(path: Path, geo: Geometry) -> None:
    """Record ``geo`` (the last step of making a pool), atomically, 0600."""
    tmp = path / f".{GEOMETRY}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"format": FORMAT, "slot_bytes": geo.slot_bytes, "slots": geo.slots, "creator": os.getpid()}, f)
    os.rename(tmp, path / GEOMETRY)


def check_geometry(name: str, have: Geometry, want: Geometry) -> None:
    """ConfigError unless a joiner wanting ``want`` fits pool ``name`` made with ``have``."""
    if have.slot_bytes != want.slot_bytes:
        raise ConfigError(f"cpu_pool host:{name} holds blocks of {have.slot_bytes} bytes, this store's are "
                          f"{want.slot_bytes}: every process of a pool needs the same block shape and dtype; "
                          f"use another pool name for this model")
    if have.slots != want.slots:
        raise ConfigError(f"cpu_pool host:{name} is {have.nbytes} bytes ({have.slots} blocks) but this process asks "
                          f"for cpu_bytes of {want.slots} blocks ({want.nbytes} bytes): give every process of the "
                          f"pool the same cpu_bytes, or use another pool name")


def in_use(path: Path) -> bool:
    """Whether some process has the pool at ``path`` open (True when that cannot be told: never removed then)."""
    users = index_users(path)
    return users is None or bool(users)


def remove(path: Path, why: str) -> None:
    """Delete the pool directory ``path`` (caller holds ``pool_lock``)."""
    log.info("cpu pool %s: removing it (%s)", path.name, why)
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def prepare(root: Path, name: str, want: Geometry) -> tuple[Path, bool]:
    """Inside ``pool_lock``: remove a dead pool of ``name``, and say whether the caller makes it anew.

    Returns ``(path, create)``: with ``create`` the directory was just made (empty, 0700) and the caller
    fills it (payload, index, then ``write_geometry``); else a live pool is there, with ``want``'s geometry.
    """
    path = root / name
    if os.path.lexists(path):
        if not in_use(path):
            remove(path, "no process uses it")
        else:
            have = read_geometry(path)
            if have is None:
                raise ConfigError(f"cpu_pool host:{name}: {str(path)!r} is in use but holds no {GEOMETRY}; stop the "
                                  f"processes using it (or remove it) and open again")
            check_geometry(name, have, want)
            return path, False
    path.mkdir(mode=0o700)
    return path, True
