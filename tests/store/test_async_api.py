"""The asyncio form of the API: handles are awaitable from an event loop, results equal wait()'s."""
from __future__ import annotations

import asyncio

import torch

from tiered_kv import TieredStore

from tests.store._blocks import blocks_of, key_of

SHAPE = (2, 4, 64)


def test_handles_are_awaitable(small_cfg):
    keys = [key_of(i) for i in range(40)]
    data = blocks_of(keys, SHAPE)

    async def main(store: TieredStore) -> tuple[list[bool], int, int]:
        accepted = await store.put(keys, data)
        await asyncio.to_thread(store.drain, 10)
        out = torch.empty_like(data)
        got, got_again = await asyncio.gather(store.get(keys[:20], out[:20]), store.get(keys[20:], out[20:]))
        assert torch.equal(out, data)
        await asyncio.to_thread(store.drain, 10)
        prefetched = await store.prefetch(keys[:4], to="gpu")
        return accepted, got + got_again, prefetched

    with TieredStore(small_cfg()) as store:
        accepted, got, prefetched = asyncio.run(main(store))
        assert accepted == [True] * 40 and got == 40 and prefetched == 4
        assert store.drain(10)
        assert store.locate(keys[:4]) == ["gpu"] * 4
