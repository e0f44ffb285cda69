"""Pick the copy mechanism for one call from the shape of its run list.

Role: the measured selection rule (docs/gpu_copy.md has the numbers behind it).
The copy engine is the default: it reaches the PCIe limit once runs are a few
tens of KiB and costs the model nothing. The SM kernel is chosen only when the
runs are small (mean run below ``sm_max_mean_run_bytes``) and there are enough
of them for the copy engine's per-descriptor cost to dominate
(``sm_min_runs``); it needs Triton.

Threading: pure functions over immutable values; safe from any thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Mechanism(str, enum.Enum):
    """How bytes move: DMA copy engine, a Triton kernel on the SMs, or torch on the CPU."""

    COPY_ENGINE = "copy_engine"
    SM_KERNEL = "sm_kernel"
    CPU = "cpu"


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
    """Return the mechanism for a GPU copy of ``num_runs`` runs totalling ``nbytes``."""
    if num_runs == 0 or not sm_kernel_available or not policy.allow_sm_kernel:
        return Mechanism.COPY_ENGINE
    mean = nbytes / num_runs
    if mean < policy.sm_max_mean_run_bytes and num_runs >= policy.sm_min_runs:
        return Mechanism.SM_KERNEL
    return Mechanism.COPY_ENGINE
