"""tests/gpu: run on the GPU machine only (scripts/run_gpu_tests.sh); skipped where torch has no CUDA."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test here ``gpu`` and skip them all when CUDA is absent."""
    skip = pytest.mark.skip(reason="needs CUDA (run scripts/run_gpu_tests.sh on the GPU machine)")
    for item in items:
        if "tests/gpu" in item.path.as_posix():
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
