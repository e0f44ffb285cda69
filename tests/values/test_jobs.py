"""TransferJob and Completion cross process boundaries as plain data."""
from __future__ import annotations

from tiered_kv.values.jobs import Completion, JobKind, TransferJob


def K(i: int) -> bytes:
    """A 32-byte key for block number ``i``."""
    return i.to_bytes(4, "little") * 8


def test_jobs_roundtrip_as_plain_data():
    job = TransferJob(7, JobKind.DEMOTE, 0, 1, [K(1)], [3], [4], 9)
    assert TransferJob.from_dict(job.to_dict()) == job
    done = Completion(7, [True], [False], 10, 0.5, "")
    assert Completion.from_dict(done.to_dict()) == done
