#!/usr/bin/env bash
# Run every test under tests/gpu on the GPU machine, in one call, from the repo root.
# Usage: scripts/run_gpu_tests.sh [pytest args...]   (extra args go to pytest)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
"$PY" - <<'PYEOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("triton", "cuda.bindings", "pytest"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"))
    except ImportError as exc:
        print(name, "MISSING:", exc)
PYEOF
exec "$PY" -m pytest -q -p no:cacheprovider --durations=12 tests/gpu "$@"
