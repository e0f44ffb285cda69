#!/usr/bin/env bash
# On the GPU machine, after the vLLM recipe's install_on_gpu.sh has put vLLM 0.26.0 in $SITE (both run by
# scripts/gpu/serve_setup.sh): reassemble the carried LMCache payload (make_payload.sh, this folder) from
# $STAGE, install LMCache + the `vllm serve` extras into $SITE (next to vLLM, pip --target, no deps; the
# "Target directory .../bin already exists" warnings are harmless), and check that (1) the OpenAI server
# imports, (2) LMCache's native extensions load from their files, (3) vLLM's LMCacheConnectorV1 path
# imports, (4) LMCache's CUDA ops are the native ones, not the pure-torch fallback its c_ops shim drops to
# with only a warning (exit 7 then: LMCache would run, slowly).
# Env: STAGE (/tmp/stage-lmc), SITE (/tmp/site), PY (python3), LMC_VERSION (0.5.3; 0.5.1 = the fallback),
#      SERVE_ONLY=1 installs only the `vllm serve` extras (no LMCache).
set -euo pipefail
STAGE=${STAGE:-/tmp/stage-lmc}; SITE=${SITE:-/tmp/site}; PY=${PY:-python3}; LMC_VERSION=${LMC_VERSION:-0.5.3}
cd "$STAGE"
want=$(cat lmc_payload.sha256)
got=$(cat lmc_part_* | sha256sum | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "lmc payload sha mismatch (have: $(ls lmc_part_*))"; exit 3; }
rm -rf x && mkdir x && cat lmc_part_* | xz -dc -T0 | tar -xf - -C x
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
"$PY" - <<'PYEOF'
import importlib, os, sys, warnings
warnings.simplefilter("ignore")
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available())
import uvicorn, vllm
import vllm.entrypoints.openai.api_server  # what `vllm serve` imports first
print("vllm", vllm.__version__, "uvicorn", uvicorn.__version__, "| OpenAI server imports OK")
if os.environ.get("SERVE_ONLY") == "1":
    sys.exit(0)
# LMCache's native extensions, loaded straight from their files (the package's c_ops name is a shim
# that falls back to pure torch ops with only a warning when the extension does not load).
import glob, importlib.machinery, importlib.util
site = os.environ.get("SITE", "/tmp/site")
for path in sorted(glob.glob(os.path.join(site, "lmcache", "*.so"))):
    name = os.path.basename(path).split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    try:
        loader.exec_module(importlib.util.module_from_spec(spec)); print("native", name, "loads")
    except Exception as e:
        print("native", name, "FAILS:", type(e).__name__, str(e)[:300]); sys.exit(6)
import lmcache
from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1  # noqa: F401
import lmcache.c_ops as ops
f = ops.multi_layer_kv_transfer
native = type(f).__name__ == "builtin_function_or_method"
if not native:  # say what the extension exposes, and why LMCache's own lazy import of it failed
    import traceback
    print("lmcache.c_ops:", getattr(ops, "__file__", None), "| multi_layer_kv_transfer is", type(f))
    try:  # the same import LMCache's CudaDeviceOps.ensure_native does, now with its traceback
        exec("import lmcache.c_ops as native", {})
    except Exception:
        traceback.print_exc(limit=4)
print("lmcache", lmcache.__version__, "device", lmcache.torch_device_type,
      "| c_ops native" if native else "| c_ops = TORCH FALLBACK (slow path)")
sys.exit(0 if (native and lmcache.torch_device_type == "cuda") else 7)
PYEOF
echo "lmcache payload installed in $SITE"
