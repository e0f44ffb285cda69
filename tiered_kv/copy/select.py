"""Pick the copy mechanism for one call from the shape of its descriptors.

Role: the measured selection rule (numbers and the runs behind them:
docs/gpu_copy.md). The copy engine is the default: batched 1-D runs reach the
PCIe limit once runs are 64 KiB (H200: 54 GB/s each way, 97 GB/s both ways)
and a concurrent bf16 matmul loses nothing measurable (-1..+0.4%). Where a block's chunks are small
but sit at a fixed pitch in one allocation, the copier turns them into one 2-D
copy per block (decided in ``dispatch.py``) and stays on the copy engine. The SM
kernel is chosen only when the copy engine would still be descriptor-bound:
mean bytes per descriptor below ``sm_max_mean_run_bytes`` and at least
``sm_min_runs`` descriptors. It wins 2-10x over 1-D runs there (2 KiB runs:
21 vs 2-5 GB/s) but it takes SMs from the model (matmul 18-33% slower with 16
CTAs, 40-54% with 32), so ``allow_sm_kernel=False`` keeps every copy on the
copy engine.

Threading: pure functions over immutable values; safe from any thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Mechanism(str, enum.Enum):
    """How bytes move: DMA copy engine, a Triton kernel on the SMs, torch on the CPU, or (loads) staged.

    ``STAGED``: whole slot rows DMA'd into a device staging buffer, then scattered on the device
    (``staged.py``); only when named: the copier's automatic rule never picks it, vLLM's connector does
    (``in_step_copy: staged`` for in-step and asynchronous loads, ``auto`` for in-step copies where the copy
    engine is descriptor-bound).
    """

    COPY_ENGINE = "copy_engine"
    SM_KERNEL = "sm_kernel"
    CPU = "cpu"
    STAGED = "staged"


@dataclass(frozen=True)
class SelectionPolicy:
    """Thresholds of the automatic choice (defaults come from the H100/H200 measurements)."""

    sm_max_mean_run_bytes: int = 16 * 1024
    sm_min_runs: int = 1024
    allow_sm_kernel: bool = True

    def __post_init__(self) -> None:
        if self.sm_max_mean_run_bytes < 0 or self.sm_min_runs < 0:
            raise ValueError(f"{self} has a negative threshold")


def choose_mechanism(
    num_runs: int, nbytes: int, sm_kernel_available: bool, policy: SelectionPolicy = SelectionPolicy()
) -> Mechanism:
    """Return the mechanism for a GPU copy of ``nbytes`` that costs the copy engine ``num_runs`` descriptors."""
    if num_runs == 0 or not sm_kernel_available or not policy.allow_sm_kernel:
        return Mechanism.COPY_ENGINE
    mean = nbytes / num_runs
    if mean < policy.sm_max_mean_run_bytes and num_runs >= policy.sm_min_runs:
        return Mechanism.SM_KERNEL
    return Mechanism.COPY_ENGINE
