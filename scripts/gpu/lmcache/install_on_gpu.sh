#!/usr/bin/env bash
# On the GPU machine, after the vLLM recipe's install_on_gpu.sh has put vLLM 0.26.0 in $SITE (both run by
# scripts/gpu/serve_setup.sh): reassemble the carried LMCache payload (make_payload.sh, this folder) from
# $STAGE, install LMCache + the `vllm serve` extras into $SITE (next to vLLM, pip --target, no deps; the
# "Target directory .../bin already exists" warnings are harmless), and check that (1) the OpenAI server
# imports, (2) vLLM's LMCacheConnectorV1 path imports, (3) in a fresh interpreter, LMCache binds its compiled
# CUDA ops the way it does inside vLLM (check_native.py, next to this script: prints a VERDICT line, the
# ImportError LMCache swallows if it does not, and runs one native transfer against LMCache's torch fallback).
# Exit status: 0 OK; 7 LMCache would run on its pure-torch fallback (slow; with vLLM 0.26's fused-K/V layout
# not even a supported one); 9 the native op disagreed with the fallback; other: a step failed.
# Env: STAGE (/tmp/stage-lmc), SITE (/tmp/site), PY (python3), LMC_VERSION (0.5.3; 0.5.1 = the fallback),
#      SERVE_ONLY=1 installs only the `vllm serve` extras (no LMCache); DRY_RUN=1 (any machine) checks and
#      unpacks the payload, lists what it would install, and stops.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)   # check_native.py sits next to this script (repo or payload)
STAGE=${STAGE:-/tmp/stage-lmc}; SITE=${SITE:-/tmp/site}; PY=${PY:-python3}; LMC_VERSION=${LMC_VERSION:-0.5.3}
cd "$STAGE"
want=$(cat lmc_payload.sha256)
got=$(cat lmc_part_* | sha256sum | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "lmc payload sha mismatch (have: $(ls lmc_part_*))"; exit 3; }
rm -rf x && mkdir x && cat lmc_part_* | xz -dc -T0 | tar -xf - -C x
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "payload OK ($(ls lmc_part_* | wc -l) part(s)); would install into $SITE:"
  ls x/pl/serve/*.whl x/pl/lmc/*.whl x/pl/alt/lmcache-"$LMC_VERSION"-*.whl 2>/dev/null \
    | grep -v "/lmcache-" || true; ls x/pl/*/lmcache-"$LMC_VERSION"-*.whl
  [ -f "$HERE/check_native.py" ] && echo "then: $PY $HERE/check_native.py (fresh interpreter)"
  rm -rf x; exit 0
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import vllm; assert vllm.__version__.startswith("0.26"), vllm.__version__' \
  || { echo "vLLM 0.26 is not importable from $SITE: run the vLLM recipe's install_on_gpu.sh first"; exit 4; }
PIPI="$PY -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target $SITE"
$PIPI x/pl/serve/*.whl
if [ "${SERVE_ONLY:-0}" != 1 ]; then
  lmc=(x/pl/lmc/lmcache-"$LMC_VERSION"-*.whl x/pl/alt/lmcache-"$LMC_VERSION"-*.whl)
  lmc_whl=""; for f in "${lmc[@]}"; do [ -f "$f" ] && lmc_whl=$f; done
  [ -n "$lmc_whl" ] || { echo "no lmcache $LMC_VERSION wheel in the payload"; exit 5; }
  rm -rf "$SITE"/lmcache "$SITE"/lmcache-*.dist-info   # switching versions: replace, don't skip
  deps=$(ls x/pl/lmc/*.whl | grep -v '/lmcache-')
  $PIPI $deps || {   # caio's manylinux_2_34 wheel needs glibc >= 2.34; fall back to its pure-Python wheel
    echo "retrying with caio's pure-Python wheel"; $PIPI $(echo "$deps" | grep -v '/caio-') x/pl/fallback/caio-*.whl; }
  $PIPI "$lmc_whl"
fi
export VLLM_NO_USAGE_STATS=1 LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
# (1) the OpenAI server and (2) vLLM's LMCacheConnectorV1 path import. This process must not touch LMCache's
# native extension files: loading c_ops by hand makes LMCache's own import of it fail (check_native.py says why).
"$PY" - <<'PYEOF'
import os, sys, warnings
warnings.simplefilter("ignore")
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available())
import uvicorn, vllm
import vllm.entrypoints.openai.api_server  # what `vllm serve` imports first
print("vllm", vllm.__version__, "uvicorn", uvicorn.__version__, "| OpenAI server imports OK")
if os.environ.get("SERVE_ONLY") == "1":
    sys.exit(0)
import lmcache
from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1  # noqa: F401
print("lmcache", lmcache.__version__, "| vLLM's LMCacheConnectorV1 + LMCache's adapter import OK")
PYEOF
[ "${SERVE_ONLY:-0}" = 1 ] && { echo "vllm serve extras installed in $SITE"; exit 0; }
# (3) in a fresh interpreter, the way vLLM's EngineCore imports LMCache: are the compiled ops bound?
rc=0; "$PY" "$HERE/check_native.py" || rc=$?
case $rc in
  0) echo "lmcache payload installed in $SITE (native CUDA ops)";;
  7|9) exit $rc;;   # 7: torch fallback, 9: native op disagrees with the fallback (serve_setup.sh: don't report lmcache)
  *) echo "check_native.py failed (exit $rc)"; exit 6;;
esac
