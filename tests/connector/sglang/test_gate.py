"""The load gate (``gate.py``): which held pages ``batch_exists`` tells SGLang about; SGLang recomputes the rest.

The rule on its own first (per tier, all or nothing: SGLang's L3 read never overlaps the request's forward),
then through SGLang's real ``HiCacheController`` (backup thread, prefetch thread's hit query, IO thread), with
our store on a real LMDB disk directory: a declined hit is a hit of 0 (SGLang recomputes), a reported one lands
bit for bit, and the context SGLang's ``prefix_keys`` give prices the recompute.
"""
from __future__ import annotations

import time

import pytest

from tests._redis import PASSWORD_ENV
from tests.connector.sglang.harness import (
    PAGE_SIZE, attached_backend, extra_config, fill_random, mha_pool, pages_bytes, running_controller,
)
from tests.connector.sglang.test_controller import _backup, _prefetch, _tokens, _wait_backup

torch = pytest.importorskip("torch")

from tiered_kv.connector.sglang.config import SGLangBackendConfig  # noqa: E402
from tiered_kv.connector.sglang.gate import PageGate  # noqa: E402
from tiered_kv.errors import ConfigError  # noqa: E402
from tiered_kv.planner.rates import PrefillModel  # noqa: E402

MIB8 = 8 << 20  # one 64-token page of a Llama-3-8B shape (128 KiB per token)


def _gate(policy="auto", gbps=3.0, probe=0, tps=30000.0, remote=None, half=32768):
    rates = {"disk": gbps} if remote is None else {"disk": gbps, "remote": remote}
    return PageGate(policy, probe, rates, PrefillModel.from_rate(tps, half), 64, MIB8)


def test_break_even_of_an_8b_page():
    """64 tokens of 128 KiB at 30k tokens/s of prefill: a disk must read > 3.93 GB/s to beat recomputing a page at
    a prompt's start (attention adds 0.1% there)."""
    snap = _gate().snapshot()
    assert snap["break_even_gbps"] == pytest.approx(3.928, abs=1e-3)
    assert not _gate(gbps=3.0).disk_beats_recompute()
    assert _gate(gbps=4.0).disk_beats_recompute()


def test_auto_keeps_memory_pages_and_declines_a_slow_disk():
    g = _gate(gbps=1.0)
    assert g.worth_loading(["cpu", "cpu", "disk", "disk"]) == 2
    assert g.worth_loading(["disk", "cpu"]) == 0  # only a leading run counts
    assert g.worth_loading(["cpu", "gpu"]) == 2
    assert g.worth_loading([]) == 0
    assert g.worth_loading(["cpu", None, "disk"]) == 1  # a page evicted since the lookup ends the run
    snap = g.snapshot()
    assert snap["gate_declined_pages"] == 4 and snap["gate_declined_queries"] == 2
    assert snap["tokens"]["disk"] == {"loaded": 0, "recomputed": 3 * 64}
    assert snap["tokens"]["cpu"] == {"loaded": 4 * 64, "recomputed": 64}  # a CPU page behind a declined disk page


def test_auto_reports_a_fast_disk():
    g = _gate(gbps=8.0)
    assert g.worth_loading(["cpu", "disk", "disk"]) == 3
    assert g.snapshot()["gate_disk_pages_reported"] == 2


def test_each_slow_tier_on_its_own_rate():
    """CPU pages, then disk pages read faster than recomputed, then remote pages read slower: report CPU + disk."""
    g = _gate(gbps=8.0, remote=1.0)
    assert g.worth_loading(["cpu"] * 2 + ["disk"] * 3 + ["remote"] * 3) == 5
    snap = g.snapshot()
    assert snap["gate_split_queries"] == 1 and snap["gate_declined_pages"] == 3
    assert snap["tokens"]["remote"] == {"loaded": 0, "recomputed": 3 * 64}
    assert snap["read_gbps"] == {"disk": 8.0, "remote": 1.0}


def test_a_page_deep_in_a_prompt_is_worth_more_than_one_at_its_start():
    """Recomputing a page costs more the more tokens it attends to: a 3 GB/s disk loses at a prompt's start (break
    even 3.93 GB/s) and wins after 32k tokens of context (break even ~2 GB/s)."""
    g = _gate(gbps=3.0)
    assert g.worth_loading(["disk"] * 4, context_pages=0) == 0
    assert g.worth_loading(["disk"] * 4, context_pages=512) == 4


def test_always_and_never():
    assert _gate("always", gbps=0.01).worth_loading(["disk"] * 5) == 5
    assert _gate("never", gbps=100.0).worth_loading(["cpu", "disk"]) == 1


def test_probe_every_nth_declined_query_then_the_estimate_follows_the_reads():
    g = _gate(gbps=1.0, probe=3)
    got = [g.worth_loading(["disk"] * 4) for _ in range(6)]
    assert got == [0, 0, 4, 0, 0, 4]
    assert g.snapshot()["gate_probes"] == 2
    for _ in range(12):  # the probes' reads ran at 20 GB/s: 8 MiB in 0.42 ms
        g.observe_read({"disk": 1}, MIB8 / 20e9)
    assert g.snapshot()["disk_gbps_estimate"] > 3.932
    assert g.worth_loading(["disk"] * 4) == 4


def test_the_default_rate_is_a_guess_the_disks_writes_bound_and_its_first_large_read_replaces():
    """``disk_read_gbps`` left at 3.0 is a guess: a disk that wrote at 0.5 GB/s is bet to read no faster, so its
    pages are declined before any read; a write under 4 MiB says nothing; the first read of 8 MiB replaces the
    estimate (20 GB/s: loaded). A rate the user set is no guess: writes leave it alone."""
    g = _gate()
    assert g.guessing() == ["disk"] and g.snapshot()["read_gbps_source"] == {"disk": "guess"}
    assert g.worth_loading(["disk"] * 4, context_pages=512) == 4  # the guess beats recompute deep in a prompt
    g.hint_write("disk", 1 << 20, (1 << 20) / 0.1e9)  # 1 MiB: latency, ignored
    assert g.snapshot()["disk_gbps_estimate"] == 3.0
    g.hint_write("disk", 64 << 20, (64 << 20) / 0.5e9)
    snap = g.snapshot()
    assert snap["disk_gbps_estimate"] == 0.5 and snap["read_gbps_source"] == {"disk": "writes"}
    assert g.worth_loading(["disk"] * 4, context_pages=512) == 0
    g.observe_read({"disk": 1}, MIB8 / 20e9)
    snap = g.snapshot()
    assert snap["disk_gbps_estimate"] == 20.0 and snap["read_gbps_source"] == {"disk": "reads"}
    assert g.guessing() == [] and g.worth_loading(["disk"] * 4) == 4
    user = _gate(gbps=2.0)
    user.hint_write("disk", 64 << 20, (64 << 20) / 0.5e9)
    assert user.guessing() == [] and user.snapshot()["read_gbps_source"] == {"disk": "set"}
    assert user.snapshot()["disk_gbps_estimate"] == 2.0


def test_tiny_pages_average_into_the_guess_instead_of_replacing_it():
    """512 B pages (the controller tests'): a read of a few of them measures latency; it is averaged into the guess
    as before, so one slow small read does not make the disk look 3,000x slower."""
    g = PageGate("auto", 0, {"disk": 3.0}, PrefillModel.from_rate(30000.0, 32768), 4, 512)
    g.observe_read({"disk": 2}, 1024 / 1e6)  # 1 MB/s
    assert g.snapshot()["disk_gbps_estimate"] == pytest.approx(0.8 * 3.0 + 0.2 * 0.001, rel=1e-3)


def test_observe_ignores_empty_reads_and_memory_pages():
    g = _gate(gbps=1.0)
    g.observe_read({"disk": 0}, 1.0)
    g.observe_read({"disk": 3}, 0.0)
    g.observe_read({"cpu": 3}, 1.0)
    assert g.snapshot()["disk_gbps_estimate"] == 1.0 and g.snapshot()["gate_reads_observed"] == 0


@pytest.mark.parametrize("extra,match", [
    ({"disk_load_policy": "sometimes"}, "disk_load_policy"),
    ({"disk_read_gbps": 0}, "disk_read_gbps"),
    ({"disk_read_gbps": True}, "disk_read_gbps"),
    ({"prefill_tokens_per_s": -5}, "prefill_tokens_per_s"),
    ({"disk_probe_every": -1}, "disk_probe_every"),
    ({"disk_probe_every": 2.5}, "disk_probe_every"),
    ({"remote_read_gbps": 0}, "remote_read_gbps"),
    ({"prefill_half_rate_context": 0}, "prefill_half_rate_context"),
])
def test_bad_gate_keys_name_themselves(extra, match):
    with pytest.raises(ConfigError, match=match):
        SGLangBackendConfig.from_extra_config({"disk_path": "/tmp/x", **extra})


# ---------------------------------------------------------------------------- real HiCacheController

def _stored(ctrl, pool, tokens, seed):
    op_id, _, expected = _backup(ctrl, pool, tokens, seed=seed)
    assert _wait_backup(ctrl, op_id) == len(tokens)
    ctrl.storage_backend.store.drain()  # every page committed to the disk tier
    return expected


def test_controller_slow_disk_is_declined_and_sglang_recomputes(tmp_path):
    pool = mha_pool("page_first")
    extra = extra_config(tmp_path, disk_read_gbps=1e-6, disk_probe_every=0)
    with running_controller(pool, extra) as ctrl:
        tokens = _tokens(100, 5)
        _stored(ctrl, pool, tokens, seed=1)
        hit, loaded, _ = _prefetch(ctrl, pool, "slow", tokens)
        assert hit == loaded == 0
        be = ctrl.storage_backend
        assert be.stats()["gate"]["gate_declined_pages"] == 5
        assert be.stats()["backend"].get("get_pages", 0) == 0  # nothing was read
        assert be.store.lookup(be._keys(_hashes(tokens))) == 5  # still held, only not worth it


def test_controller_always_loads_the_same_pages_bit_exact(tmp_path):
    pool = mha_pool("page_first")
    extra = extra_config(tmp_path, disk_read_gbps=1e-6, disk_load_policy="always")
    with running_controller(pool, extra) as ctrl:
        tokens = _tokens(300, 4)
        expected = _stored(ctrl, pool, tokens, seed=2)
        hit, loaded, dst = _prefetch(ctrl, pool, "always", tokens)
        assert hit == loaded == len(tokens)
        assert all(torch.equal(a, b) for a, b in zip(pages_bytes(pool, dst, 4), expected))
        snap = ctrl.storage_backend.stats()["gate"]
        assert snap["gate_disk_pages_reported"] == 4 and snap["gate_reads_observed"] == 1


def test_controller_memory_tier_pages_pass_a_slow_disk_gate(tmp_path):
    """With our own CPU tier in front of the disk, pages still in it are reported; the disk-only tail is not."""
    pool = mha_pool("page_first")
    page_bytes = pool.get_data_page(0, flat=True).numel() * 2
    extra = extra_config(tmp_path, disk_read_gbps=1e-6, disk_probe_every=0, cpu_bytes=3 * page_bytes)
    with running_controller(pool, extra) as ctrl:
        be = ctrl.storage_backend
        tokens, hashes, src, expected = _random_pages(pool, 700, 6, seed=3)
        # the tail first, then the head: the 3-page CPU tier keeps the head, the tail stays on disk only
        assert all(be.batch_set_v1(hashes[3:], src[3 * PAGE_SIZE:]))
        be.store.drain()
        assert all(be.batch_set_v1(hashes[:3], src[:3 * PAGE_SIZE]))
        be.store.drain()
        assert be.store.locate(be._keys(hashes)) == ["cpu"] * 3 + ["disk"] * 3
        hit, loaded, dst = _prefetch(ctrl, pool, "mixed", tokens)
        assert hit == loaded == 3 * PAGE_SIZE
        assert all(torch.equal(a, b) for a, b in zip(pages_bytes(pool, dst, 3), expected[:3]))
        assert be.stats()["gate"]["gate_declined_pages"] == 3


def test_controller_probe_measures_the_disk_and_then_reports_it(tmp_path):
    """A declined disk is probed on the 2nd query; the probe's read lifts the estimate above break-even."""
    pool = mha_pool("page_first")
    # 512 B pages of 4 tokens at 10 tokens/s of "prefill": break-even 1.28 kB/s, far below any real disk read
    extra = extra_config(tmp_path, disk_read_gbps=1e-9, disk_probe_every=2, prefill_tokens_per_s=10)
    with running_controller(pool, extra) as ctrl:
        tokens = _tokens(900, 10)
        expected = _stored(ctrl, pool, tokens, seed=4)
        assert _prefetch(ctrl, pool, "q1", tokens)[0] == 0
        hit, loaded, dst = _prefetch(ctrl, pool, "q2-probe", tokens)
        assert hit == loaded == len(tokens)
        assert all(torch.equal(a, b) for a, b in zip(pages_bytes(pool, dst, 10), expected))
        pool.free(dst)
        hit, loaded, _ = _prefetch(ctrl, pool, "q3", tokens)
        assert hit == loaded == len(tokens)
        snap = ctrl.storage_backend.stats()["gate"]
        assert snap["gate_probes"] == 1 and snap["gate_reads_observed"] >= 1
        assert snap["disk_gbps_estimate"] > snap["break_even_gbps"]


def test_controller_prefix_keys_price_the_recompute_by_its_context(tmp_path):
    """SGLang passes the hashes before the queried span (``prefix_keys``): a 4-page tail after 8 pages costs more
    to recompute than the same pages at a prompt's start, so a disk declined without context is reported with it.

    Pages of 4 tokens and 512 B; prefill 10 tokens/s, halved at 32 tokens of context; disk 900 B/s: loading the
    tail takes 2.28 s; recomputing it takes 2.03 s at context 0 and 3.63 s after 32 tokens."""
    pool = mha_pool("page_first")
    extra = extra_config(tmp_path, disk_read_gbps=0.9e-6, disk_probe_every=0, prefill_tokens_per_s=10,
                         prefill_half_rate_context=32)
    with running_controller(pool, extra) as ctrl:
        tokens = _tokens(300, 12)
        expected = _stored(ctrl, pool, tokens, seed=5)
        hashes = _hashes(tokens)
        tail = tokens[8 * PAGE_SIZE:]
        assert _prefetch(ctrl, pool, "no-context", tail, last_hash=hashes[7])[0] == 0  # prefix_keys [] : context 0
        hit, loaded, dst = _prefetch(ctrl, pool, "context", tail, last_hash=hashes[7], prefix_keys=hashes[:8])
        assert hit == loaded == len(tail)
        assert all(torch.equal(a, b) for a, b in zip(pages_bytes(pool, dst, 4), expected[8:]))
        snap = ctrl.storage_backend.stats()["gate"]
        assert snap["gate_declined_queries"] == 1 and snap["tokens"]["disk"]["loaded"] == len(tail)


def test_controller_cpu_then_disk_then_recompute_the_remote_part(tmp_path, redis_cluster):
    """A hit split over three tiers: the CPU pages and the disk pages (a disk faster than recompute) are reported and
    land bit for bit; the remote-only pages (a fleet tier slower than recompute) are left to SGLang to recompute."""
    pool = mha_pool("page_first")
    page_bytes = pool.get_data_page(0, flat=True).numel() * 2
    # 3 CPU pages, 6 disk slots of 4 KiB; every page is also written to Redis (remote_write: through)
    extra = extra_config(tmp_path, cpu_bytes=3 * page_bytes, disk_bytes=6 * 4096, disk_read_gbps=100.0,
                         remote_read_gbps=1e-9, disk_probe_every=0, prefill_tokens_per_s=10,
                         remote_url=redis_cluster.url, remote_password_env=PASSWORD_ENV,
                         tenant_salt=f"split-{time.monotonic_ns()}")
    with running_controller(pool, extra) as ctrl:
        be = ctrl.storage_backend
        tokens, hashes, src, expected = _random_pages(pool, 500, 9, seed=6)
        for lo in (6, 3, 0):  # the tail first: the CPU tier keeps the head, the disk the head and the middle
            assert all(be.batch_set_v1(hashes[lo:lo + 3], src[lo * PAGE_SIZE:(lo + 3) * PAGE_SIZE]))
            assert be.store.drain(30)
        assert be.store.locate(be._keys(hashes)) == ["cpu"] * 3 + ["disk"] * 3 + ["remote"] * 3
        hit, loaded, dst = _prefetch(ctrl, pool, "three-tiers", tokens)
        assert hit == loaded == 6 * PAGE_SIZE
        assert all(torch.equal(a, b) for a, b in zip(pages_bytes(pool, dst, 6), expected[:6]))
        snap = be.stats()["gate"]
        assert snap["tokens"] == {"cpu": {"loaded": 12, "recomputed": 0}, "disk": {"loaded": 12, "recomputed": 0},
                                  "remote": {"loaded": 0, "recomputed": 12}}
        assert snap["gate_split_queries"] == 1


def _random_pages(pool, start, pages, seed):
    """Tokens of ``pages`` pages from ``start``, their page hashes, host slots of random KV for them, and its bytes."""
    tokens = _tokens(start, pages)
    fill_random(pool, seed=seed)
    src = pool.alloc(len(tokens))
    return tokens, _hashes(tokens), src, pages_bytes(pool, src, pages)


def _hashes(tokens):
    from sglang.srt.mem_cache.utils import get_hash_str

    return get_hash_str(tokens, None, page_size=PAGE_SIZE)


def test_backend_bounds_the_guess_by_the_disks_own_writes_then_replaces_it_by_a_read(tmp_path):
    """A real host pool of 1 MiB pages (64 tokens, 4 layers, 8 heads of 128, bf16) on a real disk tier, the read
    rate left at its default: the 8-page write job (8 MiB, the disk's own) bounds the guess at its rate (when below
    3.0 GB/s) before any read, as the store reports it to the gate; the 8 MiB read of ``batch_get_v1`` then
    replaces it, and writes no longer move it."""
    pool = mha_pool("page_first", page_size=64, layers=4, heads=8, head_dim=128, dev_tokens=512)
    backend = attached_backend(extra_config(tmp_path, disk_load_policy="always"), pool)
    try:
        assert backend.pages.page_nbytes == 1 << 20
        rate = backend.gate.split.rates["disk"]
        assert backend.gate.guessing() == ["disk"] and rate.source == "guess"
        got = []
        backend.store.on_write(lambda tier, nbytes, seconds: got.append((tier, nbytes, seconds)))
        fill_random(pool, 5)
        keys = [f"w{i}" for i in range(8)]
        assert all(backend.batch_set_v1(keys, pool.alloc(8 * 64)))
        assert backend.store.drain(30)
        writes = [(n, sec) for t, n, sec in got if t == "disk"]
        assert len(writes) == 1 and writes[0][0] == 8 << 20  # one job of the batch's 8 pages
        assert backend.batch_exists(keys) == 8
        written = writes[0][0] / writes[0][1] / 1e9
        assert rate.source == "writes" and rate.gbps == pytest.approx(min(3.0, written))
        dst = pool.alloc(8 * 64)
        assert backend.batch_get_v1(keys, dst) == [True] * 8
        assert rate.source == "reads" and rate.reads == 1 and backend.gate.guessing() == []
        after_read = rate.gbps
        pool.free(dst)
        assert all(backend.batch_set_v1([f"x{i}" for i in range(8)], pool.alloc(8 * 64)))
        assert backend.store.drain(30) and backend.batch_exists(keys) == 8
        assert rate.gbps == after_read  # a measured rate follows reads only
    finally:
        backend.close()


def test_a_re_attached_backend_hints_its_new_stores_writes_from_zero(tmp_path):
    """SGLang re-attaches (``register_mem_pool_host`` again: a new store): the gate, kept, listens to the new store
    too, so its first 8 MiB write still bounds the guess the old one's bounded."""
    pool = mha_pool("page_first", page_size=64, layers=4, heads=8, head_dim=128, dev_tokens=512)
    backend = attached_backend(extra_config(tmp_path, disk_load_policy="always"), pool)
    try:
        rate = backend.gate.split.rates["disk"]
        fill_random(pool, 6)
        for round_, keys in enumerate(([f"a{i}" for i in range(8)], [f"b{i}" for i in range(8)])):
            if round_:
                backend.register_mem_pool_host(pool)  # the re-attach: same gate, a new store
            got = []
            backend.store.on_write(lambda tier, nbytes, seconds, got=got: got.append(tier))
            src = pool.alloc(8 * 64)
            assert all(backend.batch_set_v1(keys, src))
            pool.free(src)
            assert backend.store.drain(30) and got.count("disk") == 1
            assert backend.batch_exists(keys) == 8
            assert rate.hints == round_ + 1 and rate.source == "writes"
    finally:
        backend.close()
