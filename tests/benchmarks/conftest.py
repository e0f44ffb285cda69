"""Fixtures for the benchmark scripts' tests.

Threading contract: pytest's thread only.
"""
from __future__ import annotations

import tempfile

import pytest


@pytest.fixture(autouse=True)
def _model_dirs_in_tmp(tmp_path, monkeypatch):
    """``serve_bench`` leaves its model directory for the next call (``serving.shapes.stable_model_dir``, under
    ``tempfile.gettempdir()``): here it goes into the test's own temporary directory, not the machine's /tmp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
