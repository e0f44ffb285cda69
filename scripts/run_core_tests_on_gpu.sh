#!/usr/bin/env bash
# On the GPU machine: run the core suites (tiers, planner, store, examples) with CUDA present, so the
# GPU tier, pinned CPU tier and CUDA-stream mover paths run for real (CI covers their CPU fallback).
# Expects our wheels in .whl (lmdb zstandard xxhash prometheus-client pyyaml) and optionally .whl-extra (rich).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tkv-site .whl/*.whl .whl-extra/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/tkv-site:. TKV_STRESS_SECONDS=${TKV_STRESS_SECONDS:-10}
python3 -c "import torch; print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
python3 -m pytest -q -p no:cacheprovider -rs tests/values tests/planner tests/copy tests/tiers tests/store "$@"
