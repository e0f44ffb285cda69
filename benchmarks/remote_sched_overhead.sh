#!/usr/bin/env bash
# Scheduler step cost with the remote tier configured (issue 15): starts a local 3-master Redis Cluster
# (tests/_redis.py's launcher), runs benchmarks/sched_overhead_runs.sh with TKV_REMOTE_URL set (modes: none,
# offloading, tiered_kv, tiered_kv + remote), stops the cluster.
# TKV_FLEET_ALL_MODES=1: a control for a box this small, where the fleet process and Redis share the cores
# with the scheduler: a second fleet process announces the same rate on a stream no engine reads during
# every mode, so each mode runs beside the same Redis and fleet load and only the engine's reaction to the
# feed differs between the remote mode and the others.
# Usage: benchmarks/remote_sched_overhead.sh [REPS] [PYTHON]   (from the repo root; run it alone on the box)
set -euo pipefail
REPS="${1:-3}"
PY="${2:-.venv/bin/python}"
DIR=$(mktemp -d /tmp/tkv-sched-redis.XXXXXX)
"$PY" - "$DIR" <<'PYEOF' > "$DIR/url"
import sys
from pathlib import Path
sys.path.insert(0, ".")
from tests._redis import RedisCluster
c = RedisCluster(Path(sys.argv[1]) / "cluster")
c.create()
Path(sys.argv[1], "pids").write_text(" ".join(str(p.pid) for p in c.procs))
print(c.url)
PYEOF
FLEET_PID=""
cleanup() {
  [ -z "$FLEET_PID" ] || kill "$FLEET_PID" 2>/dev/null || true
  kill $(cat "$DIR/pids") 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
export TKV_REMOTE_URL=$(cat "$DIR/url") TKV_REMOTE_PASSWORD_ENV=TKV_TEST_REDIS_PASSWORD
export TKV_TEST_REDIS_PASSWORD=$("$PY" -c "import sys; sys.path.insert(0, '.'); from tests._redis import PASSWORD; print(PASSWORD)")
if [ "${TKV_FLEET_ALL_MODES:-0}" = 1 ]; then
  export TKV_EXTRA="{\"remote_url\": \"$TKV_REMOTE_URL\",
                     \"remote_password_env\": \"$TKV_REMOTE_PASSWORD_ENV\"}"
  STREAM_HEX=$(printf 'tkv-bench|background-fleet' | od -An -tx1 | tr -d ' \n')
  PYTHONPATH="$PWD" "$PY" benchmarks/remote_sched_mode.py fleet "$STREAM_HEX" \
    "${TKV_FLEET_KEYS_PER_S:-1000}" $$ &
  FLEET_PID=$!
fi
benchmarks/sched_overhead_runs.sh "$REPS" "$PY"
