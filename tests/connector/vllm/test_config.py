"""The connector's config, key and capacity rules, without a scheduler (fast)."""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from tiered_kv.connector.vllm.config import (
    ConnectorConfig,
    capacities,
    hash_identity,
    namespace,
    rank_disk_dir,
)
from tiered_kv.connector.vllm.common import CPU, DISK
from tiered_kv.connector.vllm.geometry import Geometry
from tiered_kv.connector.vllm.scheduler import SchedulerPlanner
from tiered_kv.errors import ConfigError
from tiered_kv.values.keys import KEY_LEN, PREFIX_LEN, Namespace
from tiered_kv.values.jobs import Completion


def geo(tp: int = 1, k: int = 16, block_bytes: int = 2 << 20) -> Geometry:
    return Geometry(16, k, ("l0", "l1"), block_bytes, tp, "vllm|test")


def test_unknown_key_is_named_with_the_valid_ones():
    with pytest.raises(ConfigError, match=r"cpu_byte.*valid keys.*cpu_bytes"):
        ConnectorConfig.from_extra_config({"cpu_byte": "1GiB"})


@pytest.mark.parametrize("key,value,needle", [
    ("cpu_bytes", "lots", "cpu_bytes"), ("eviction", "mru", "eviction"), ("store_policy", "lazy", "store_policy"),
    ("disk_load_policy", "sometimes", "disk_load_policy"), ("chunk_blocks", 0, "chunk_blocks"),
    ("disk_read_gbps", -1, "disk_read_gbps"), ("promote_on_hit", "yes", "promote_on_hit"),
    ("cpu_bytes", 0, "cpu_bytes"), ("remote_feed_interval_s", -0.1, "remote_feed_interval_s"),
    ("remote_feed_interval_s", "fast", "remote_feed_interval_s"),
    ("remote_feed_interval_s", True, "remote_feed_interval_s"),
    ("remote_read_gbps", 0, "remote_read_gbps.*or null"), ("prefill_half_rate_context", 0, "prefill_half_rate_context"),
    ("prefill_learn", "yes", "prefill_learn"), ("prefill_tokens_per_s", "fast", "prefill_tokens_per_s"),
    ("tail_chunks", "yes", "tail_chunks.*auto"), ("tail_chunks", 1, "tail_chunks.*auto"),
    ("store_start", "later", "store_start.*after_sampler"), ("staged_scatter", "triton", "staged_scatter.*kernel"),
])
def test_bad_values_fail_naming_the_key(key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        ConnectorConfig.from_extra_config({key: value})


def test_sizes_parse_and_capacities_are_per_engine():
    cfg = ConnectorConfig.from_extra_config({"cpu_bytes": "64GiB", "disk_path": "/nvme/kv", "disk_bytes": "1TiB"})
    assert cfg.cpu_bytes == 64 << 30 and cfg.disk_bytes == 1 << 40
    one, two = capacities(cfg, geo(1)), capacities(cfg, geo(2))
    assert one == ((64 << 30) // (32 << 20), (1 << 40) // (32 << 20)), one  # 2 MiB blocks, 16 per chunk
    assert two[0] == one[0] // 2 and two[1] == one[1] // 2  # each rank holds its share of every chunk


def test_capacity_smaller_than_a_chunk_is_refused():
    with pytest.raises(ConfigError, match="smaller than one chunk"):
        capacities(ConnectorConfig(cpu_bytes="16MiB"), geo())


def test_namespace_key_equals_its_definition():
    """The scheduler keys blocks with Namespace.key (cached keyed hasher): it must equal the plain form."""
    ns = Namespace("m", 7, "salt", (("hash", "sha256"),))
    for h in (b"\x00" * 32, bytes(range(32)), b"short"):
        assert ns.key(h) == ns.prefix + hashlib.blake2b(h, digest_size=KEY_LEN - PREFIX_LEN, key=ns.prefix).digest()


def test_namespace_separates_models_seeds_chunking_and_ranks_get_own_dirs():
    cfg = ConnectorConfig(disk_path="/nvme/kv")
    stable = SimpleNamespace(algo="sha256", seed="env:0", stable=True)
    a = namespace(cfg, geo(), "m1", stable)
    assert a.prefix != namespace(cfg, geo(), "m2", stable).prefix
    assert a.prefix != namespace(cfg, geo(k=8), "m1", stable).prefix
    assert a.prefix != namespace(cfg, geo(), "m1", SimpleNamespace(algo="sha256", seed="env:1", stable=True)).prefix
    assert rank_disk_dir(cfg, a, 0, 2) != rank_disk_dir(cfg, a, 1, 2)
    assert rank_disk_dir(ConnectorConfig(), a, 0, 1) is None


def test_pythonhashseed_makes_hashes_stable():
    ident = hash_identity("xxhash", env={"PYTHONHASHSEED": "0"})
    assert ident.stable and ident.seed == "env:0"


def test_unseeded_xxhash_is_unstable():
    pytest.importorskip("vllm")
    assert not hash_identity("xxhash", env={}).stable


def _store(planner: SchedulerPlanner, keys: list[bytes]) -> None:
    """Put ``keys`` in the CPU tier through the chain's own put/complete path."""
    for job in planner.chain.put(keys, handle=10**9):
        planner.chain.complete(Completion(job.job_id, [True] * len(job)))
    planner.chain.take_finished()


def _request(n_tokens: int, rid: str = "r"):
    hashes = [bytes([i % 256]) * 32 for i in range(n_tokens // 16)]
    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=n_tokens, num_prompt_tokens=n_tokens)


@pytest.mark.parametrize("policy,gbps,probe,expect_chunks", [
    ("never", 100.0, 32, 1), ("always", 0.001, 32, 3), ("auto", 100.0, 32, 3), ("auto", 0.001, 32, 1),
    ("auto", 0.001, 1, 3),  # every declined hit is a probe: the slow disk is read (and measured) anyway
])
def test_disk_hits_are_taken_only_when_worth_it(policy, gbps, probe, expect_chunks):
    cfg = ConnectorConfig(disk_path="/x", disk_load_policy=policy, disk_read_gbps=gbps, chunk_blocks=4,
                          disk_probe_every=probe)
    g = geo(k=4, block_bytes=128 << 10)
    planner = SchedulerPlanner(cfg, g, Namespace("m"), cpu_chunks=8, disk_chunks=8)
    req = _request(16 * 16 + 5)
    keys = planner._requests.chunk_keys(planner._requests.state(req), 3)
    planner.chain.adopt(DISK, keys[1:])  # chunks 1 and 2 sit on disk (a reopened tier)
    _store(planner, keys[:1])  # chunk 0 in the CPU tier
    assert planner.chain.locate(keys) == [CPU, DISK, DISK]
    assert planner.match(req, 0) == expect_chunks * 4 * 16


def test_n_minus_one_rule_never_reports_the_whole_prompt():
    cfg = ConnectorConfig(chunk_blocks=1)
    planner = SchedulerPlanner(cfg, geo(k=1), Namespace("m"), cpu_chunks=64, disk_chunks=0)
    req = _request(4 * 16)
    keys = planner._requests.chunk_keys(planner._requests.state(req), 4)
    _store(planner, keys)
    assert planner.match(req, 0) == 3 * 16  # 4 blocks held, the last one is recomputed
    assert planner.match(req, 16) == 2 * 16
    assert planner.match(req, 8) == 0  # a local hit inside a block: no external hit


def test_fence_check_names_only_published_jobs_on_the_blocks_handed_out():
    """The block-indexed fence map: blocks past every published one are never busy (checked without a lookup), a
    mix of both is answered from the published ones, and an ended job's blocks are no longer busy."""
    planner = SchedulerPlanner(ConnectorConfig(chunk_blocks=4), geo(k=4), Namespace("m"), cpu_chunks=8,
                               disk_chunks=0)
    planner._blocks.job_gpu[7] = [3, 4, 9]
    planner._blocks.publish(7, [3, 4, 9])
    planner._blocks.job_gpu[8] = [5]
    planner._blocks.publish(8, [5])
    assert planner._blocks.busy_jobs([10, 11, 40]) == set()  # all past block 9: never published
    assert planner._blocks.busy_jobs([40, 4, 5, 2]) == {7, 8}  # some past, some published
    assert planner._blocks.busy_jobs([9]) == {7} and planner._blocks.busy_jobs([0, 1, 2, 6]) == set()
    planner._blocks.untrack(7)
    assert planner._blocks.busy_jobs([3, 4, 9, 5]) == {8}


# ---------------------------------------------------------------------------------- KV cache groups
def _vllm_config(tp: int = 1, spec_decode=None, **parallel):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, **parallel),
        cache_config=SimpleNamespace(kv_cache_layout="NHD", enable_prefix_caching=True),
        speculative_config=spec_decode)


def _groups(*specs):
    names = iter(f"model.layers.{i}.attn" for i in range(100))
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[next(names), next(names)], kv_cache_spec=s)
                                            for s in specs], hash_block_size=16)


def _spec(kind: str, **kw):
    import torch

    vllm_spec = pytest.importorskip("vllm.v1.kv_cache_interface")
    common = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    if kind == "swa":
        return vllm_spec.SlidingWindowSpec(sliding_window=kw.pop("window", 128), **common, **kw)
    if kind == "local":
        return vllm_spec.ChunkedLocalAttentionSpec(attention_chunk_size=1024, **common)
    if kind == "mla":
        return vllm_spec.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                                          cache_dtype_str="auto")
    return vllm_spec.FullAttentionSpec(**common)


def test_hybrid_geometry_keeps_one_part_per_group_and_tags_every_group():
    from tiered_kv.connector.vllm.geometry import geometry

    geo = geometry(_vllm_config(), _groups(_spec("swa", window=128), _spec("full")), chunk_blocks=16)
    swa, full = geo.groups
    assert (swa.kind, swa.chunk_blocks, swa.stored, swa.window_blocks, swa.window_chunks) == ("swa", 16, 16, 8, 1)
    assert (full.kind, full.stored, full.window_blocks) == ("full", 16, 0)
    page = 16 * 2 * 64 * 2 * 2
    # a slot holds one group's part: 16 blocks of 2 layers, whichever group
    assert geo.parts and geo.rank_chunk_nbytes == 16 * 2 * page and geo.slot_blocks == 32
    assert geo.plane_rows == [16, 16] and not geo.block_level_errors
    assert "swa:SlidingWindowSpec" in geo.tag and "part=16" in geo.tag and geo.tag.startswith("vllm|parts|")
    wide = geometry(_vllm_config(), _groups(_spec("swa", window=1024), _spec("full")), chunk_blocks=16)
    assert (wide.groups[0].window_blocks, wide.groups[0].window_chunks) == (64, 4)  # a window of 4 chunks
    # a hit's bytes: full attention for every token, the window's blocks only
    assert geo.hit_nbytes(4096) == 256 * 2 * page + 8 * 2 * page
    # the split gate prices a hybrid hit at those bytes (a single-group model keeps the per-unit price)
    from tiered_kv.connector.vllm.config import ConnectorConfig
    from tiered_kv.connector.vllm.prefill import split_gate

    gate = split_gate(ConnectorConfig(), geo, ["cpu", "disk"])
    assert gate.hit_nbytes is not None and gate.hit_nbytes(4096) == geo.hit_nbytes(4096)
    single = geometry(_vllm_config(), _groups(_spec("full")), chunk_blocks=16)
    assert split_gate(ConnectorConfig(), single, ["cpu", "disk"]).hit_nbytes is None


def test_parts_slot_fits_every_groups_blocks():
    from tiered_kv.connector.vllm.geometry import GroupGeo, parts_slot_nbytes

    groups = (GroupGeo("full", 16, ("a",) * 5, 5 * 100, 4, 4), GroupGeo("swa", 16, ("b",) * 4, 4 * 100, 4, 4, 8))
    slot = parts_slot_nbytes(groups)
    assert slot == 2000 and slot % 500 == 0 and slot % 400 == 0  # 4 blocks of 5 layers = 5 blocks of 4


def test_one_full_attention_group_keeps_the_single_group_geometry():
    from tiered_kv.connector.vllm.geometry import geometry

    geo = geometry(_vllm_config(), _groups(_spec("full")), chunk_blocks=4)
    legacy = Geometry(16, 4, ("model.layers.0.attn", "model.layers.1.attn"), 2 * 16 * 2 * 64 * 2 * 2, 1, geo.tag)
    assert geo.tag.startswith("vllm|FullAttentionSpec|") and "groups" not in geo.tag
    assert (geo.rank_chunk_nbytes, geo.slot_blocks, geo.block_level_errors) == (legacy.rank_chunk_nbytes, 4, True)
    assert geo.rank_layout(0).fingerprint == legacy.rank_layout(0).fingerprint


@pytest.mark.parametrize("specs,needle", [
    (("local", "full"), "--disable-hybrid-kv-cache-manager"),
])
def test_unsupported_groups_are_refused_with_what_to_do(specs, needle):
    from tiered_kv.connector.vllm.geometry import geometry

    with pytest.raises(ConfigError, match=needle):
        geometry(_vllm_config(), _groups(*(_spec(k) for k in specs)), 16)


def test_sliding_window_with_speculative_decoding_is_refused():
    from tiered_kv.connector.vllm.geometry import geometry

    with pytest.raises(ConfigError, match="speculative decoding"):
        geometry(_vllm_config(spec_decode=object()), _groups(_spec("swa"), _spec("full")), 16)


def test_mla_with_tp_is_stored_once_unless_turned_off_or_sharded():
    from tiered_kv.connector.vllm.geometry import geometry

    once = geometry(_vllm_config(tp=4), _groups(_spec("mla")), 16)
    assert once.replicated and once.chunk_nbytes == once.rank_chunk_nbytes
    cfg = ConnectorConfig(cpu_bytes=once.rank_chunk_nbytes * 8, disk_path="/x", disk_bytes=once.rank_chunk_nbytes * 8)
    assert capacities(cfg, once) == (8, 8)  # one copy for all ranks: not divided by 4
    assert not geometry(_vllm_config(tp=4), _groups(_spec("mla")), 16, mla_store_once=False).replicated
    assert not geometry(_vllm_config(tp=4, pipeline_parallel_size=2), _groups(_spec("mla")), 16).replicated
    assert not geometry(_vllm_config(tp=1), _groups(_spec("mla")), 16).replicated
    ns = namespace(ConnectorConfig(), once, "m", SimpleNamespace(algo="sha256", seed="x", stable=True))
    assert ("tp", "replicated") in ns.extra
    assert str(rank_disk_dir(ConnectorConfig(disk_path="/d"), ns, 3, 4, True)).endswith("/replicated")


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_tail_chunks_takes_a_bool_or_auto_and_defaults_to_auto(value):
    assert ConnectorConfig.from_extra_config({"tail_chunks": value}).tail_chunks == value
    assert ConnectorConfig.from_extra_config({}).tail_chunks == "auto"
