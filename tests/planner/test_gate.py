"""The load gate shared by the vLLM connector and the SGLang backend (``tiered_kv.planner.gate``)."""
from __future__ import annotations

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.planner.gate import ALL_FAST, ALWAYS, BEATS, DECLINED, PROBE, LoadGate

MIB8 = 8 << 20  # one unit: 8 MiB for 64 tokens; break-even at 30k tokens/s = 3.93 GB/s


def test_memory_hits_always_load_and_policies_decide_the_rest():
    assert LoadGate("never", 1.0, 0, 30000, 64, MIB8).decide(4, 4) == (4, ALL_FAST)
    assert LoadGate("always", 0.1, 0, 30000, 64, MIB8).decide(1, 4) == (4, ALWAYS)
    assert LoadGate("never", 100.0, 0, 30000, 64, MIB8).decide(1, 4) == (1, DECLINED)
    assert LoadGate("auto", 8.0, 0, 30000, 64, MIB8).decide(1, 4) == (4, BEATS)
    assert LoadGate("auto", 2.0, 0, 30000, 64, MIB8).decide(1, 4) == (1, DECLINED)


def test_declined_tier_is_probed_and_the_estimate_follows_reads():
    g = LoadGate("auto", 2.0, 3, 30000, 64, MIB8)
    assert g.break_even_gbps() == pytest.approx(MIB8 * 30000 / 64 / 1e9)
    assert [g.decide(0, 2)[1] for _ in range(6)] == [DECLINED, DECLINED, PROBE, DECLINED, DECLINED, PROBE]
    for _ in range(20):
        g.observe(MIB8, MIB8 / 10e9)  # reads at 10 GB/s
    assert g.gbps == pytest.approx(10.0, rel=0.05) and g.beats_recompute()
    assert g.decide(0, 2) == (2, BEATS)
    g.observe(0, 1.0)
    g.observe(MIB8, 0.0)  # nothing moved / no time: ignored
    assert g.gbps == pytest.approx(10.0, rel=0.05)


def test_bad_policy_and_unit_are_config_errors():
    with pytest.raises(ConfigError, match="disk_load_policy"):
        LoadGate("sometimes", 1.0, 0, 30000, 64, MIB8)
    with pytest.raises(ConfigError, match="unit"):
        LoadGate("auto", 1.0, 0, 30000, 0, MIB8)
