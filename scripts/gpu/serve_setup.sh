#!/usr/bin/env bash
# On the GPU machine, from the repo root, after the carry calls of scripts/gpu/README.md: install what
# benchmarks/serve_bench.py needs into $SITE (/tmp/site) and check it imports.
#   1. vLLM 0.26.0 from /tmp/stage (the vLLM recipe's payload + its install_on_gpu.sh, which empties $SITE
#      first; skipped when $SITE already has vLLM 0.26 or SKIP_VLLM=1)
#   2. the `vllm serve` extras + LMCache 0.5.3 from /tmp/stage-lmc (scripts/gpu/lmcache/install_on_gpu.sh;
#      SERVE_ONLY=1: the extras only, for runs without the lmcache modes)
#   3. our package's wheels the image lacks (lmdb, zstandard) from /tmp/whl, if carried there
# (stage folders: STAGE_VLLM, STAGE_LMC, WHL override the /tmp defaults; PY the interpreter)
# Then: PYTHONPATH=$SITE:. python3 benchmarks/serve_bench.py ...
# Exit status: 0 when everything imports and LMCache's compiled CUDA ops bind (a "VERDICT: LMCACHE NATIVE OPS
# USED" line); 7 when only those are missing, 9 when they bind but a native transfer disagreed with LMCache's
# torch fallback (the other modes still run; don't report the lmcache modes); anything else: a step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
SITE=${SITE:-/tmp/site}; PY=${PY:-python3}
STAGE_VLLM=${STAGE_VLLM:-/tmp/stage}; STAGE_LMC=${STAGE_LMC:-/tmp/stage-lmc}; WHL=${WHL:-/tmp/whl}
export SITE PY

have_vllm() { PYTHONPATH="$SITE" "$PY" -c 'import vllm, sys; sys.exit(0 if vllm.__version__.startswith("0.26") else 1)' 2>/dev/null; }
if [ "${SKIP_VLLM:-0}" = 1 ] || have_vllm; then
  echo "vLLM 0.26 already in $SITE"
else
  [ -f "$STAGE_VLLM/install_on_gpu.sh" ] || {
    echo "no $STAGE_VLLM/install_on_gpu.sh: copy ../shared/tools/vllm-on-gpu/install_on_gpu.sh into .carry-vllm/p2/ and carry it"; exit 2; }
  STAGE="$STAGE_VLLM" SITE="$SITE" bash "$STAGE_VLLM/install_on_gpu.sh" || exit $?
fi

lmc_rc=0
STAGE="$STAGE_LMC" bash scripts/gpu/lmcache/install_on_gpu.sh || lmc_rc=$?
if [ "$lmc_rc" != 0 ] && [ "$lmc_rc" != 7 ] && [ "$lmc_rc" != 9 ]; then
  echo "LMCache / serve extras install failed (exit $lmc_rc)"; exit "$lmc_rc"
fi

if ls "$WHL"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$SITE" "$WHL"/*.whl \
    || { echo "our wheels failed to install"; exit 4; }
fi

PYTHONPATH="$SITE:." VLLM_NO_USAGE_STATS=1 "$PY" - <<'PYEOF' || exit 5
import importlib
for name in ("aiohttp", "matplotlib", "tokenizers", "lmdb", "zstandard", "uvloop"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "ok"))
    except ImportError as exc:
        print(name, "MISSING:", exc)
import vllm
import tiered_kv.connector.vllm.connector  # noqa: F401  (our connector, as vLLM will load it)
print("vllm", vllm.__version__, "| tiered_kv connector imports")
PYEOF
[ "$lmc_rc" = 7 ] && echo "WARNING: LMCache's native CUDA ops did not bind (exit 7): lmcache modes would use" \
  "its torch fallback"
[ "$lmc_rc" = 9 ] && echo "WARNING: LMCache's native transfer disagreed with its torch fallback (exit 9):" \
  "don't report lmcache"
exit "$lmc_rc"
