"""RadixIndex: token prefixes to chunk keys. Pure Python."""
from __future__ import annotations

import pytest

from tests.planner._driver import K
from tiered_kv.errors import InvalidInputError
from tiered_kv.planner.radix import RadixIndex


def test_radix_match_insert_evict():
    r = RadixIndex(page_size=2, max_pages=3)
    r.insert([1, 2, 3, 4, 5], [K(1), K(2)])
    assert r.match([1, 2, 3, 4, 9, 9]) == [K(1), K(2)]
    assert r.match([1, 2, 7, 7]) == [K(1)]
    assert r.match([9]) == []
    r.insert([7, 7, 8, 8], [K(7), K(8)])
    assert len(r) <= 3
    with pytest.raises(InvalidInputError):
        r.insert([1, 2], [K(1), K(2)])
