#!/usr/bin/env bash
# Create the project's virtual environments (idempotent; a finished venv is marked with .tkv-ready).
#   .venv          torch 2.13.0 (CPU) + vLLM 0.32.0 + tiered_kv[dev]   -> core, vLLM connector, reliability tests
#   (tiered_kv[dev] pins redis==8.1.0 + hiredis==3.5.0; redis-server comes from apt, for the remote-tier tests)
#   .venv-sglang   torch 2.13.0 (CPU) + SGLang 0.5.23 (--no-deps recipe) + tiered_kv[dev] -> SGLang tests
# Usage: scripts/setup_venvs.sh [core|vllm|sglang|all]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-all}
PY=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
# pip here warns once per package about index locations that do not exist; keep the log readable.
pipq() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; return "${PIPESTATUS[0]}"; }

make_core() {  # $1 = venv dir
  local V=$1
  if [ ! -x "$V/bin/python" ]; then log "creating $V"; "$PY" -m venv "$V"; fi
  pipq "$V/bin/pip" install -q --upgrade pip
  pipq "$V/bin/pip" install -q "torch==2.13.0"
}

# The remote tier's tests start a real Redis Cluster: Debian's redis-server (Redis 7) when missing. The Grafana
# dashboard's test checks its PromQL with promtool: Debian's prometheus package (no service is started).
apt_missing=()
command -v redis-server >/dev/null 2>&1 || apt_missing+=(redis-server)
command -v promtool >/dev/null 2>&1 || apt_missing+=(prometheus)
if [ ${#apt_missing[@]} -gt 0 ] && [ "$WHAT" != core ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing ${apt_missing[*]} (apt)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${apt_missing[@]}"; } >/dev/null 2>&1 \
      || log "apt-get install ${apt_missing[*]} failed: the remote-tier and dashboard tests will fail under CI"
  else
    log "${apt_missing[*]} missing and not root: apt-get install ${apt_missing[*]} (remote-tier and dashboard tests)"
  fi
fi

if [ "$WHAT" = core ] || [ "$WHAT" = vllm ] || [ "$WHAT" = all ]; then
  V=.venv
  if [ -f "$V/.tkv-ready" ] && [ "$WHAT" != core ]; then
    log "$V ready"
    # new pins, or an install from before the vllm.general_plugins entry point (the connector by name)
    "$V/bin/python" -c "import redis, hiredis, matplotlib, importlib.metadata as m
assert any(e.name == 'tiered_kv' for e in m.entry_points(group='vllm.general_plugins'))" 2>/dev/null \
      || pipq "$V/bin/pip" install -q -e ".[dev,bench]"
  else
    t0=$SECONDS
    make_core "$V"
    if [ "$WHAT" != core ]; then
      log "installing vllm==$VLLM_VERSION into $V (about 3 minutes)"
      pipq "$V/bin/pip" install -q "vllm==$VLLM_VERSION" "torch==2.13.0"
      # PyPI's torchvision/torchaudio/torchcodec binaries do not load beside the CPU torch; vLLM's
      # scheduler path does not need them.
      "$V/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    pipq "$V/bin/pip" install -q -e ".[dev,bench]"  # bench: matplotlib for benchmarks/serving/plot.py
    [ "$WHAT" != core ] && touch "$V/.tkv-ready"
    log "$V done in $((SECONDS - t0)) s"
  fi
fi

if [ "$WHAT" = sglang ] || [ "$WHAT" = all ]; then
  V=.venv-sglang
  if [ -f "$V/.tkv-ready" ]; then
    log "$V ready"
    "$V/bin/python" -c "import redis, hiredis" 2>/dev/null || pipq "$V/bin/pip" install -q -e ".[dev]"  # new pins
  else
    t0=$SECONDS
    make_core "$V"
    log "installing sglang==$SGLANG_VERSION (CPU, --no-deps recipe) into $V (about 2 minutes)"
    pipq "$V/bin/pip" install -q -c scripts/sglang-cpu-constraints.txt \
      torch numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec \
      pydantic pyzmq tqdm ipython aiohttp transformers dill apache-tvm-ffi sentencepiece \
      compressed-tensors gguf ninja
    pipq "$V/bin/pip" install -q --no-deps "sglang==$SGLANG_VERSION"
    pipq "$V/bin/pip" install -q -e ".[dev]"
    touch "$V/.tkv-ready"
    log "$V done in $((SECONDS - t0)) s"
  fi
fi
