"""Security: storage is data, never code; files are private; namespaces and paths are enforced.

What this proves (docs/reliability.md, "Security"):
- no module of ``tiered_kv/`` imports or calls pickle, cPickle, dill, marshal, shelve,
  joblib, ``torch.load``, ``eval``/``exec``/``compile``, or an unsafe YAML loader (AST scan);
- a pickle payload planted as a record — as the LMDB value of a key the store knows, and as
  a record of a key it does not — reads as a miss (the first is counted as corrupt) and is
  never unpickled (its side effect, creating a directory, never happens);
- with umask 0, the store directory and ``index/`` are 0700 and ``data.mdb``,
  ``lock.mdb``, ``payload.bin`` are 0600; a pre-existing 0755 store directory is tightened;
- two models, and two tenants (different salts), with identical tokens on one directory
  never read each other's blocks (``match_prefix`` and ``get`` miss), while the same
  namespace does (control);
- ``disk_path`` with ``..`` or a symlink (to a directory outside) is refused with
  ConfigError, and nothing is created at the symlink's target; a ``payload.bin`` or
  ``index`` inside the store directory that is a symlink pointing outside is refused too.

Threading contract: single-threaded tests.
"""
from __future__ import annotations

import ast
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch

from tests.reliability._common import REPO, SHAPE, TORCH_DTYPE, blocks_of, disk_config, key_of
from tiered_kv.errors import ConfigError
from tiered_kv.store.tiered_store import TieredStore

BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "marshal", "shelve", "joblib", "cloudpickle"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}
BANNED_ATTRS = {("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"), ("yaml", "full_load"),
                ("yaml", "load_all"), ("numpy", "load"), ("np", "load"), ("pickle", "loads"), ("pickle", "load")}


def test_no_unpickling_or_eval_in_the_library():
    findings = []
    for py in sorted((REPO / "tiered_kv").rglob("*.py")):
        tree = ast.parse(py.read_text(), str(py))
        for node in ast.walk(tree):
            where = f"{py.relative_to(REPO)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                findings += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in BANNED_MODULES:
                findings.append(f"{where} from {node.module} import ...")
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in BANNED_CALLS:
                    findings.append(f"{where} {f.id}()")
                elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and \
                        (f.value.id, f.attr) in BANNED_ATTRS:
                    findings.append(f"{where} {f.value.id}.{f.attr}()")
    assert not findings, "storage must never be unpickled or evaluated:\n" + "\n".join(findings)


class _Boom:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def test_planted_pickle_record_reads_as_miss_and_is_never_unpickled(tmp_path):
    sentinel = tmp_path / "PWNED"
    payload = pickle.dumps(_Boom(str(sentinel)))
    keys = [key_of(i, b"sec") for i in range(4)]
    stranger = key_of(99, b"sec")
    path = tmp_path / "kv"
    with TieredStore(disk_config(path, disk_bytes=1 << 20)) as store:
        assert all(store.put(keys, blocks_of(keys)).wait(30))
        disk = store.tiers[-1]
        with disk.index.env.begin(write=True) as txn:  # a record the planner knows now holds a pickle
            txn.put(keys[0], payload, db=disk.index.db_records)
            txn.put(stranger, payload, db=disk.index.db_records)
        out = torch.empty((1, *SHAPE), dtype=TORCH_DTYPE)
        assert store.get([keys[0]], out).wait(30) == 0
        assert store.stats()["tiers"]["disk"]["corrupt_dropped"] == 1
        assert store.get(keys[1:], torch.empty((3, *SHAPE), dtype=TORCH_DTYPE)).wait(30) == 3
    with TieredStore(disk_config(path, disk_bytes=1 << 20)) as store:  # reopen: the stranger is not adopted
        assert store.get([stranger], torch.empty((1, *SHAPE), dtype=TORCH_DTYPE)).wait(30) == 0
        assert not store.contains([stranger, keys[0]])[0]
    assert not sentinel.exists(), "a pickle read from storage was executed"


def test_store_files_are_private_even_with_umask_0(tmp_path):
    path = tmp_path / "a" / "b" / "kv"
    old = os.umask(0)
    try:
        TieredStore(disk_config(path, disk_bytes=1 << 20)).close()
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(path) == 0o700 and mode(path / "index") == 0o700
    for f in ("index/data.mdb", "index/lock.mdb", "payload.bin"):
        assert mode(path / f) == 0o600, f"{f} is {oct(mode(path / f))}"
    os.chmod(path, 0o755)
    TieredStore(disk_config(path, disk_bytes=1 << 20)).close()
    assert mode(path) == 0o700, "reopening did not tighten a 0755 store directory"


@pytest.mark.parametrize("a,b", [({"model": "llama"}, {"model": "qwen"}),
                                 ({"model": "m", "tenant_salt": "alice"}, {"model": "m", "tenant_salt": "bob"}),
                                 ({"model": "m", "tenant_salt": ""}, {"model": "m", "tenant_salt": "bob"})])
def test_two_namespaces_with_identical_tokens_never_share_blocks(tmp_path, a, b):
    path = tmp_path / "kv"
    tokens = list(range(1000, 1000 + 16 * 4))
    with TieredStore(disk_config(path, disk_bytes=1 << 20, page_size=16, **a)) as sa:
        ka = sa.keys_for_tokens(tokens)
        assert all(sa.put_tokens(tokens, blocks_of(ka)).wait(30))
        sa.flush()
    with TieredStore(disk_config(path, disk_bytes=1 << 20, page_size=16, **b)) as sb:
        kb = sb.keys_for_tokens(tokens)
        assert not set(ka) & set(kb)
        assert sb.match_prefix(tokens)["num_tokens"] == 0
        assert sb.get(kb, torch.empty((4, *SHAPE), dtype=TORCH_DTYPE)).wait(30) == 0
    with TieredStore(disk_config(path, disk_bytes=1 << 20, page_size=16, **a)) as sa2:  # control: same namespace
        assert sa2.match_prefix(tokens)["num_tokens"] == 64
        out = torch.empty((4, *SHAPE), dtype=TORCH_DTYPE)
        assert sa2.get(ka, out).wait(30) == 4 and torch.equal(out.view(torch.int16), blocks_of(ka).view(torch.int16))


@pytest.mark.parametrize("budget", ["namespace", "shared"])
def test_another_namespaces_keys_are_refused_and_its_records_never_read(tmp_path, budget):
    """Issue 17: given the raw key bytes of another namespace on the same directory, a store refuses them
    (InvalidInputError naming the namespace); opaque keys another namespace wrote are a miss and a put of
    them is refused (False), so no record is ever shared or overwritten across namespaces."""
    from tiered_kv.errors import InvalidInputError

    path = tmp_path / "kv"
    tokens = list(range(2000, 2000 + 16 * 3))
    opaque = [key_of(i, b"opaque") for i in range(3)]
    with TieredStore(disk_config(path, disk_bytes=1 << 20, model="alpha", disk_budget=budget)) as a:
        ka = a.keys_for_tokens(tokens)
        assert all(a.put_tokens(tokens, blocks_of(ka)).wait(30)) and all(a.put(opaque, blocks_of(opaque)).wait(30))
        with TieredStore(disk_config(path, disk_bytes=1 << 20, model="beta", disk_budget=budget)) as b:
            out = torch.empty((3, *SHAPE), dtype=TORCH_DTYPE)
            for call in (lambda: b.get(ka, out), lambda: b.contains(ka), lambda: b.put(ka, blocks_of(ka)),
                         lambda: b.lookup(ka[:1]), lambda: b.delete(ka)):
                with pytest.raises(InvalidInputError, match="namespace"):
                    call()
            assert b.get(opaque, out).wait(30) == 0 and b.contains(opaque) == [False] * 3
            assert b.put(opaque, torch.zeros((3, *SHAPE), dtype=TORCH_DTYPE)).wait(30) == [False] * 3
            assert b.drain(30) and b.lookup(opaque) == 0
        out = torch.empty((3, *SHAPE), dtype=TORCH_DTYPE)
        same = lambda ks: torch.equal(out.view(torch.int16), blocks_of(ks).view(torch.int16))  # noqa: E731
        assert a.get(opaque, out).wait(30) == 3 and same(opaque)
        assert a.get(ka, out).wait(30) == 3 and same(ka)


def test_dotdot_and_symlinked_disk_paths_are_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "store").mkdir()
    for bad in [tmp_path / "store" / ".." / "outside" / "kv", Path("..") / "kv", f"{tmp_path}/store/../kv"]:
        with pytest.raises(ConfigError, match=r"\.\."):
            TieredStore(disk_config(bad, disk_bytes=1 << 20))
    link = tmp_path / "store" / "kv"
    link.symlink_to(outside, target_is_directory=True)
    with pytest.raises(ConfigError, match="symlink"):
        TieredStore(disk_config(link, disk_bytes=1 << 20))
    dangling = tmp_path / "store" / "kv2"
    dangling.symlink_to(outside / "not-yet")
    with pytest.raises(ConfigError, match="symlink"):
        TieredStore(disk_config(dangling, disk_bytes=1 << 20))
    assert list(outside.iterdir()) == [], "something was created at a refused symlink's target"


@pytest.mark.parametrize("inner", ["payload.bin", "index"])
def test_symlinks_inside_the_store_directory_are_refused(tmp_path, inner):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / ("victim.bin" if inner == "payload.bin" else "victim-dir")
    if inner == "payload.bin":
        victim.write_bytes(b"precious")
    else:
        victim.mkdir()
    path = tmp_path / "kv"
    path.mkdir(mode=0o700)
    (path / inner).symlink_to(victim)
    try:
        TieredStore(disk_config(path, disk_bytes=1 << 20)).close()
    except ConfigError:
        pass
    if inner == "payload.bin":
        assert victim.read_bytes() == b"precious", "the store resized/wrote a file outside its directory"
    else:
        assert list(victim.iterdir()) == [], "the store created its index outside its directory"
