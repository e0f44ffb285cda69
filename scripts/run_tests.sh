#!/usr/bin/env bash
# Run every CPU test suite in its environment; fail if any suite fails or collects no tests
# (pytest exit 5 must never pass silently). Called by `make test` and .ci/run.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONHASHSEED=${PYTHONHASHSEED:-0}
rc=0
# The connector suites must never skip for want of their engine: check the imports first.
.venv/bin/python -c "import vllm, sys; print('vllm', vllm.__version__)" || { echo "!!! vLLM does not import in .venv"; exit 1; }
PYTHONPATH=scripts/cpu_stubs .venv-sglang/bin/python -c "import sglang.srt.mem_cache.hicache_storage, importlib.metadata as m; print('sglang', m.version('sglang'))" \
  || { echo "!!! SGLang does not import in .venv-sglang"; exit 1; }
# The remote tier's suites start a real Redis Cluster: redis-server must be there (setup_venvs.sh installs it).
command -v redis-server >/dev/null && command -v redis-cli >/dev/null \
  || { echo "!!! redis-server/redis-cli missing: run scripts/setup_venvs.sh as root (apt-get install redis-server)"; exit 1; }
export TKV_REQUIRE_REDIS=1  # the cluster fixture fails instead of skipping
# The Grafana dashboard's test checks every expression with promtool (setup_venvs.sh installs it).
command -v promtool >/dev/null || { echo "!!! promtool missing: run scripts/setup_venvs.sh as root (apt-get install prometheus)"; exit 1; }
run() {  # name, python, args...
  local name=$1 py=$2; shift 2
  echo "=== $name: $py -m pytest $*"
  "$py" -m pytest "$@"
  local r=$?
  if [ $r -eq 5 ]; then echo "!!! $name collected no tests"; rc=1; elif [ $r -ne 0 ]; then echo "!!! $name failed (exit $r)"; rc=1; fi
}
sglang_tests=$(ls tests/connector/sglang/test_*.py 2>/dev/null)
run "core + vLLM connector + reliability" .venv/bin/python -q -rs -p no:cacheprovider tests \
  $(for f in $sglang_tests; do echo --ignore="$f"; done)
if [ -n "$sglang_tests" ]; then
  PYTHONPATH=scripts/cpu_stubs run "SGLang backend" .venv-sglang/bin/python -q -p no:cacheprovider $sglang_tests \
    tests/connector/test_readme_commands.py tests/packaging/test_wheel.py
else
  echo "!!! no SGLang tests found"; rc=1
fi
exit $rc
