"""CPU tests of ``copy.warm_copy_paths``: the start-up round trip through a private slab leaves the engine's KV as it
was, never writes the CPU tier's slab, and a failure is logged rather than raised (the GPU side, where it binds the
driver's entry points and starts the submitter threads: tests/gpu/test_copy_gpu.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from tiered_kv.copy import BlockCopier, Mechanism, allocate_slab, warm_copy_paths
from tiered_kv.copy.copier import prepare_copier
from tiered_kv.copy.testing import Shape, all_cases, fill_random, storages

SHAPE = Shape(layers=3, heads=2, block_size=4, head_dim=8, num_blocks=5)


def _copiers(case, seed: int):
    gen = torch.Generator().manual_seed(seed)
    layout = case.build(SHAPE, torch.bfloat16, "cpu")
    fill_random(layout, gen)
    tier = allocate_slab(6, layout.block_nbytes, pin=False)
    tier.copy_(torch.randint(0, 256, tier.shape, dtype=torch.uint8, generator=gen))
    scratch = allocate_slab(2, layout.block_nbytes, pin=False)
    scratch.zero_()
    return layout, BlockCopier(layout, tier), tier, BlockCopier(layout, scratch), scratch


@pytest.mark.parametrize("case", all_cases(), ids=lambda c: c.name)
@pytest.mark.parametrize("choice", ["auto", "copy_engine", "staged", "sm_kernel"])
def test_the_round_trip_keeps_the_kv_and_never_writes_the_tier(case, choice, caplog):
    layout, copier, tier, scratch_copier, scratch = _copiers(case, seed=7)
    kv_before = [flat.clone() for flat in storages(layout)]
    tier_before = tier.clone()
    with caplog.at_level(logging.INFO, logger="tiered_kv.copy.copier"):
        assert warm_copy_paths([copier], [scratch_copier], choice, "test") is not None  # None: it failed
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # on CPU layouts the load half goes as CPU in-step loads do: the staged path only where it is named
    back = "staged" if choice == "staged" else "cpu"
    assert any(f"round trip by {back}" in r.message for r in caplog.records)
    for flat, before in zip(storages(layout), kv_before):
        assert torch.equal(flat, before)  # block 0 got its own bytes back; no other block was touched
    assert torch.equal(tier, tier_before)  # the CPU tier's slab (maybe another process's) only ever read
    # the store half of the round trip ran: the private slot holds block 0's bytes (zeros before)
    expect = allocate_slab(1, layout.block_nbytes, pin=False)
    BlockCopier(layout, expect).gpu_to_cpu([0], [0]).wait()
    assert torch.equal(scratch[0, :layout.block_nbytes], expect[0])
    assert not scratch[1].any()


def test_a_failed_warm_up_is_logged_and_the_copiers_still_work(caplog):
    case = all_cases()[0]
    layout, copier, tier, scratch_copier, _ = _copiers(case, seed=3)

    def broken(*_a, **_k):
        raise RuntimeError("no pinned memory left")

    scratch_copier.gpu_to_cpu = broken  # the fault, injected on our own object
    with caplog.at_level(logging.WARNING, logger="tiered_kv.copy.copier"):
        assert warm_copy_paths([copier], [scratch_copier], "auto", "rank 3") is None
    assert any("rank 3" in r.message and "no pinned memory left" in r.message and "first copies pay" in r.message
               for r in caplog.records)
    copier.cpu_to_gpu([2], [1]).wait()  # the in-step copier loads as before
    got = allocate_slab(1, layout.block_nbytes, pin=False)
    BlockCopier(layout, got).gpu_to_cpu([1], [0]).wait()
    assert torch.equal(got[0], tier[2])


def test_prepare_on_cpu_creates_nothing_and_copies_nothing():
    layout, copier, tier, _, _ = _copiers(all_cases()[0], seed=5)
    kv_before = [flat.clone() for flat in storages(layout)]
    wanted = [Mechanism.COPY_ENGINE, Mechanism.STAGED]
    assert prepare_copier(copier, wanted) == set(wanted)  # nothing to bind on CPU, nothing refused
    assert copier._staged is None and not copier._lanes._streams
    assert all(torch.equal(f, b) for f, b in zip(storages(layout), kv_before))


def test_the_scratch_copiers_keep_no_staging_buffer_after_the_warm_up():
    layout, copier, _, scratch_copier, _ = _copiers(all_cases()[0], seed=9)
    assert warm_copy_paths([copier], [scratch_copier], "staged", "test") is not None
    assert scratch_copier._staged is None  # the one-block buffer the staged round trip took is let go


def test_without_the_drivers_entry_points_the_warm_up_skips_the_round_trip_quietly(caplog):
    """No cuda-python (a supported set-up: the copies fall back) makes the round trip's store refuse; that is an
    INFO line and a warm-up that still counts as done, not a WARNING at every start."""
    from tiered_kv.copy import BackendUnavailableError

    layout, copier, _, scratch_copier, _ = _copiers(all_cases()[0], seed=4)

    def refused(*_a, **_k):
        raise BackendUnavailableError("the copy engine needs cuda-python")

    scratch_copier.gpu_to_cpu = refused  # what GpuDispatcher.decide raises there, injected on our own object
    with caplog.at_level(logging.INFO, logger="tiered_kv.copy.copier"):
        assert warm_copy_paths([copier], [scratch_copier], "auto", "rank 0") is not None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("no round trip" in r.message and "cuda-python" in r.message for r in caplog.records)
    assert any("round trip by none" in r.message for r in caplog.records)
