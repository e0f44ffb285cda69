#!/usr/bin/env bash
# Scheduler-side cost of TieredKVConnector vs no connector vs vLLM's OffloadingConnector, and the
# floor: benchmarks/probes/null_connector.py's NullConnector (answers every hook with nothing), i.e.
# what vLLM's connector plumbing alone costs.
#
# Runs ../shared/tools/sched_overhead.py (vLLM's real Scheduler, 64 requests x 8,192-token
# prompts, 32 output tokens, CPU only) for each mode, alternating modes, REPS times, and
# prints one RESULT line per run plus a median table. Run it alone on the machine: the
# numbers are per-step times and other processes move them; SCHED_CLOCK=thread times the scheduler
# thread's CPU time instead (benchmarks/probes/thread_clock.py), which a busy box moves much less.
# SCHED_GC=engine: a control with the garbage collector as vLLM's engine leaves it (benchmarks/probes/engine_gc.py).
# SCHED_CALIB=1: each run also times a fixed piece of Python work in its own process
# beside every step (benchmarks/probes/box_speed.py), and the table adds the comparison over the runs at the set's best
# box speed (benchmarks/sched_overhead_json.py).
#
# With TKV_REMOTE_URL (and TKV_REMOTE_PASSWORD_ENV) set, a fourth mode runs TieredKVConnector with the
# remote tier on that cluster (benchmarks/remote_sched_mode.py; TKV_FLEET_KEYS_PER_S chunks/s announced
# by the "fleet" meanwhile, default 1000). benchmarks/remote_sched_overhead.sh starts a local cluster for it.
#
# Usage: benchmarks/sched_overhead_runs.sh [REPS] [PYTHON]   (from the repo root)
set -euo pipefail
REPS="${1:-3}"
PY="${2:-.venv/bin/python}"
TOOL="${SCHED_OVERHEAD_TOOL:-../shared/tools/sched_overhead.py}"
[ -f "$TOOL" ] || TOOL=/work/shared/tools/sched_overhead.py
OUT="${OUT:-bench_out}/sched_overhead_$(date -u +%Y%m%dT%H%M%SZ).jsonl"
mkdir -p "$(dirname "$OUT")"
MODES=(${SCHED_MODES:-none benchmarks.probes.null_connector:NullConnector offloading tiered_kv.connector.vllm:TieredKVConnector})
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's tiered_kv and benchmarks/, not an installed copy
if [ -n "${TKV_REMOTE_URL:-}" ]; then
  MODES+=(benchmarks.remote_sched_mode:ExtraFromEnvConnector)
  export TKV_EXTRA="{\"remote_url\": \"$TKV_REMOTE_URL\", \"remote_password_env\": \"${TKV_REMOTE_PASSWORD_ENV:-}\"}"
  export TKV_FLEET_KEYS_PER_S="${TKV_FLEET_KEYS_PER_S:-1000}"
fi
# SCHED_CLOCK=thread: time the scheduler thread's CPU time instead of wall time (a shared, busy box)
CLOCK_WRAPPER=""
[ "${SCHED_CLOCK:-wall}" = thread ] && CLOCK_WRAPPER=benchmarks/probes/thread_clock.py
# SCHED_GC=engine: the collector state vLLM's EngineCore leaves (freeze_gc_heap after building the Scheduler),
# so the ~95 measured steps do not depend on each mode's start-up allocations (benchmarks/probes/engine_gc.py)
[ "${SCHED_GC:-tool}" = engine ] && CLOCK_WRAPPER="$CLOCK_WRAPPER benchmarks/probes/engine_gc.py"
# SCHED_CALIB=1: last wrapper before the tool, so it calibrates on the clock the tool times with
[ "${SCHED_CALIB:-0}" = 1 ] && CLOCK_WRAPPER="$CLOCK_WRAPPER benchmarks/probes/box_speed.py"
echo "# $(date -u +%FT%TZ) host=$(hostname) cpus=$(nproc) python=$PY reps=$REPS clock=${SCHED_CLOCK:-wall}" \
  "gc=${SCHED_GC:-tool} calib=${SCHED_CALIB:-0}" | tee "$OUT.log"
for rep in $(seq 1 "$REPS"); do
  for mode in "${MODES[@]}"; do
    run=$("$PY" ${CLOCK_WRAPPER} "$TOOL" "$mode" 2>/dev/null)
    line=$(echo "$run" | grep '^RESULT ' | sed 's/^RESULT //')
    calib=$(echo "$run" | grep '^CALIB ' | sed 's/^CALIB //' || true)
    if [ -n "$calib" ]; then  # one JSON line: the run's result and its box speed
      line=$("$PY" -c 'import json, sys; print(json.dumps({**json.loads(sys.argv[1]), **json.loads(sys.argv[2])}))' \
        "$line" "$calib")
    fi
    echo "$line" | tee -a "$OUT"
  done
done
# one implementation of the medians and paired ratios: the results JSON's
"$PY" benchmarks/sched_overhead_json.py --table "$OUT"
