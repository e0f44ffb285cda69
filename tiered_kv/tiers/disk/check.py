"""Integrity check of a disk tier's LMDB index, run in a child process.

LMDB trusts its own B-tree pages: a damaged branch or leaf page can make it read past the map or
abort the process (SIGSEGV, SIGBUS, ``mdb_assert``). So before a process opens an existing index
for writing, ``check_index`` runs this file as a script in a child process, which:

1. compares the data file's size with what its meta page says (a truncated file);
2. walks every named database (every key and value: each branch, leaf and overflow page the
   B-trees reach) and compares the entries it saw with the count LMDB keeps;
3. runs one small write transaction (put and delete a probe key), which makes LMDB load its
   free-page list, the part a walk of the named databases does not reach;
4. lists records whose ownership entries (budget.py) are missing or disagree: damage inside a
   value, which a B-tree walk cannot see. The opener drops those records.

A child that exits cleanly reports what it walked; a child that dies reports damage. The parent
never touches a page of a damaged index.

``tiered-kv repair`` runs it with ``--dump`` to salvage the records a damaged index still yields.

Run as ``python -I check.py [--lmdb-from DIR] <index dir>`` (as a script it imports only the standard
library and ``lmdb``, not tiered_kv, so it starts in tens of milliseconds). It prints one JSON line.
``-I`` ignores ``PYTHONPATH``, so ``child_command`` passes the directory the parent imported ``lmdb``
from (an engine started with ``PYTHONPATH=/some/site`` has it nowhere else). A child that cannot import
``lmdb`` at all exits 4: the check did not run, which is not damage.

Threading contract: ``check_index`` may be called from any thread; it blocks until the child ends.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

#: seconds the child may take before the index counts as damaged (it hangs, or the disk is that slow)
CHECK_TIMEOUT_S = 120.0
#: the child's exit status when it cannot import lmdb: the check did not run (not damage)
NO_LMDB_EXIT = 4


def child_command(*args: str) -> list[str]:
    """The command line that runs this file in an isolated child (``-I``) with ``args``, telling the
    child where this process found ``lmdb`` (``-I`` drops ``PYTHONPATH``, where some installs put it)."""
    cmd = [sys.executable, "-I", str(Path(__file__).resolve())]
    try:
        import lmdb  # noqa: F401  (only its location is wanted)

        cmd += ["--lmdb-from", str(Path(lmdb.__file__).resolve().parent.parent)]
    except ImportError:  # the child then says it has no lmdb either: a skipped check
        pass
    return cmd + list(args)


def check_index(idx: str | os.PathLike, timeout: float = CHECK_TIMEOUT_S) -> dict:
    """Walk the LMDB index at ``idx`` in a child process. Returns ``{"ok": bool, "error": str, ...}``
    plus, when ok, ``entries`` (per database), ``pages``, ``index_bytes`` and ``seconds``."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run(child_command(str(idx)), capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the integrity check did not finish in {timeout:.0f} s"}
    except OSError as exc:  # cannot start a child at all: say so, do not call the index damaged
        return {"ok": True, "error": f"integrity check skipped: {exc}", "skipped": True}
    lines = r.stdout.decode(errors="replace").strip().splitlines()
    report = {}
    if lines:
        try:
            report = json.loads(lines[-1])
        except ValueError:
            report = {}
    if r.returncode == NO_LMDB_EXIT:  # the child could not import lmdb: nothing was checked, nothing is damaged
        return {"ok": True, "error": f"integrity check skipped: {report.get('error', 'no lmdb in the child')}",
                "skipped": True}
    if r.returncode < 0:
        return {"ok": False, "error": f"the check process was killed by signal {-r.returncode} reading the "
                                      f"index (LMDB aborts on damaged pages)"}
    if r.returncode != 0 or not report:
        err = report.get("error") or r.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no report"]
        return {"ok": False, "error": err if isinstance(err, str) else err[0]}
    report["seconds"] = time.perf_counter() - t0
    return report


def _walk(idx: Path) -> dict:
    """The child's side: walk, count, probe. Raises on anything wrong."""
    import lmdb

    data = idx / "data.mdb"
    env = lmdb.open(str(idx), readonly=True, lock=True, max_dbs=16, subdir=True, readahead=False)
    try:
        psize = env.stat()["psize"]
        need = (env.info()["last_pgno"] + 1) * psize
        # The size is read after the meta page: another process sharing the directory may commit (and grow
        # the file) at any time, and LMDB writes a commit's pages before its meta page, so a file measured
        # after the meta is at least as long as that meta needs. Measured before it, a live store that grew
        # in between looked truncated and was moved aside as damaged (seen with four processes, 2026-11-23).
        size = data.stat().st_size
        if size < need:
            raise ValueError(f"data.mdb is truncated ({size} bytes, its meta page needs {need})")
        entries: dict[str, int] = {}
        pages = 0
        with env.begin(buffers=True) as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
            for name in names:
                db = env.open_db(name, txn=txn, create=False)
                n = nbytes = 0
                for k, v in txn.cursor(db=db):
                    n += 1
                    nbytes += len(k) + len(v)
                st = txn.stat(db)
                if st["entries"] != n:
                    raise ValueError(f"database {name!r}: walked {n} entries, LMDB counts {st['entries']}")
                pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
                entries[name.decode(errors="replace")] = n
            orphans = _orphans(env, txn, names)
    finally:
        env.close()
    env = lmdb.open(str(idx), map_size=data.stat().st_size + (64 << 20), max_dbs=16, subdir=True, readahead=False, sync=False,
                    metasync=False)
    try:
        meta = env.open_db(b"meta", create=False) if b"meta" in names else None
        with env.begin(write=True, db=meta) as txn:
            txn.put(b"__integrity_probe__", b"1")
            txn.delete(b"__integrity_probe__")
    finally:
        env.close()
    return {"ok": True, "error": "", "entries": entries, "pages": pages, "index_bytes": size,
            "orphans": [k.hex() for k in orphans]}


def _orphans(env, txn, names: list[bytes]) -> list[bytes]:
    """Record keys whose ownership entries are missing or disagree (damage inside a value or key of the
    budget's databases, which a B-tree walk cannot see): the opener drops those records (a miss, never
    another namespace's block)."""
    if not {b"records", b"owners", b"order"} <= set(names):
        return []
    records = env.open_db(b"records", txn=txn, create=False)
    owners = env.open_db(b"owners", txn=txn, create=False)
    order = env.open_db(b"order", txn=txn, create=False)
    meta = env.open_db(b"meta", txn=txn, create=False)
    if txn.get(b"acct", db=meta) is None:
        return []  # accounting not built yet: the opener builds it
    in_order = set()
    for k, _ in txn.cursor(db=order):
        k = bytes(k)
        in_order.add((k[:16], k[16:]))
    bad = []
    for key, _ in txn.cursor(db=records):
        key = bytes(key)
        own = txn.get(key, db=owners)
        if own is None or len(own) != 16 or (bytes(own), key) not in in_order:
            bad.append(key)
    return bad


def _dump(idx: Path) -> None:
    """``--dump``: print what can still be read of a damaged index, one JSON line per item, flushed, so a
    crash part-way keeps every line before it: ``{"meta": {name: hex}}``, then ``{"k", "h", "o"}`` per record
    (key, header, owner entry; hex)."""
    import lmdb

    env = lmdb.open(str(idx), readonly=True, lock=False, max_dbs=16, subdir=True, readahead=False)
    with env.begin(buffers=False) as txn:
        names = [bytes(k) for k, _ in txn.cursor()]
        meta = {}
        if b"meta" in names:
            for k, v in txn.cursor(db=env.open_db(b"meta", txn=txn, create=False)):
                meta[k.decode(errors="replace")] = v.hex()
        sys.stdout.write(json.dumps({"meta": meta}) + "\n")
        sys.stdout.flush()
        owners = env.open_db(b"owners", txn=txn, create=False) if b"owners" in names else None
        if b"records" not in names:
            return
        for k, v in txn.cursor(db=env.open_db(b"records", txn=txn, create=False)):
            o = txn.get(k, db=owners) if owners is not None else None
            sys.stdout.write(json.dumps({"k": k.hex(), "h": v.hex(), "o": None if o is None else o.hex()}) + "\n")
            sys.stdout.flush()


def main(argv: list[str]) -> int:
    """Script entry: walk ``argv[0]`` and print one JSON line; exit 0 when sound, 3 when damaged.
    With ``--dump`` first, print what can be salvaged instead (``_dump``). ``--lmdb-from DIR`` before
    either adds ``DIR`` at the end of ``sys.path`` when ``lmdb`` is not importable without it; exit 4 when
    ``lmdb`` cannot be imported (no check ran)."""
    lmdb_from = None
    if argv[:1] == ["--lmdb-from"] and len(argv) > 1:
        lmdb_from, argv = argv[1], argv[2:]
    try:
        try:
            import lmdb  # noqa: F401
        except ImportError:
            if lmdb_from is None:
                raise
            sys.path.append(lmdb_from)  # after the standard library: nothing there shadows it
            import lmdb  # noqa: F401,F811
    except ImportError as exc:
        sys.stdout.write(json.dumps({"ok": False, "error": f"cannot import lmdb: {exc}"}) + "\n")
        sys.stdout.flush()
        return NO_LMDB_EXIT
    if argv and argv[0] == "--dump":
        try:
            _dump(Path(argv[1]))
        except Exception as exc:  # what was printed before stays usable
            sys.stdout.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
            return 3
        return 0
    try:
        out = _walk(Path(argv[0]))
        code = 0
    except Exception as exc:  # any finding at all is damage; the parent reads the line
        out, code = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, 3
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
