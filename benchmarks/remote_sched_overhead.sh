#!/usr/bin/env bash
# Scheduler step cost with the remote tier configured (issue 15): starts a local 3-master Redis Cluster
# (tests/_redis.py's launcher), runs benchmarks/sched_overhead_runs.sh with TKV_REMOTE_URL set (modes: none,
# offloading, tiered_kv, tiered_kv + remote), stops the cluster.
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
cleanup() { kill $(cat "$DIR/pids") 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
export TKV_REMOTE_URL=$(cat "$DIR/url") TKV_REMOTE_PASSWORD_ENV=TKV_TEST_REDIS_PASSWORD
export TKV_TEST_REDIS_PASSWORD=$("$PY" -c "import sys; sys.path.insert(0, '.'); from tests._redis import PASSWORD; print(PASSWORD)")
benchmarks/sched_overhead_runs.sh "$REPS" "$PY"
