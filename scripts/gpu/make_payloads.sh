#!/usr/bin/env bash
# Build every payload a GPU session carries, on the CPU machine (it reaches the package index), from the repo root:
#   bash scripts/gpu/make_payloads.sh            vLLM 0.26 (re-cut for the carry limit), `vllm serve` + LMCache, our wheels
#   REDIS=1 bash scripts/gpu/make_payloads.sh    also Debian's redis-server for the fleet rows (.carry-redis)
# A payload already built is kept (delete its folder to rebuild). Output, each folder one device call's carry
# (scripts/gpu/README.md, "Device calls"): .carry-v2/q0, .carry-v2/q1, .carry-v2/q2 + .whl, .carry-lmcache/p0.
# The device tool carries at most 64 MiB per call including the tracked tree; the last lines check that every
# call's carry fits with the tree as it is now (exit 3 when one does not).
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED=${SHARED:-../shared/tools/vllm-on-gpu}
LIMIT=$((64 * 1024 * 1024))

ignored() { git check-ignore -q "$1/" || { echo "$1/ is not git-ignored: add '/.carry-*/' to .gitignore first"; exit 2; }; }
for d in .carry-vllm .carry-v2 .carry-lmcache .whl; do ignored "$d"; done

if [ ! -f .carry-vllm/p2/install_on_gpu.sh ]; then
  echo "== vLLM 0.26.0 payload (about a minute)"
  rm -rf .carry-vllm
  bash "$SHARED/make_payload.sh" .carry-vllm
  cp "$SHARED/install_on_gpu.sh" .carry-vllm/p2/
fi
if [ ! -f .carry-v2/q2/install_on_gpu.sh ]; then
  echo "== re-cut into 45 MiB pieces (same bytes, same sha256)"
  rm -rf .carry-v2 && mkdir -p .carry-v2/q0 .carry-v2/q1 .carry-v2/q2
  head -c 47185920 .carry-vllm/p0/part_0 > .carry-v2/q0/part_0a
  tail -c +47185921 .carry-vllm/p0/part_0 > .carry-v2/q1/part_0b
  head -c 31457280 .carry-vllm/p1/part_1 > .carry-v2/q1/part_1a
  tail -c +31457281 .carry-vllm/p1/part_1 > .carry-v2/q2/part_1b
  cp .carry-vllm/p2/* .carry-v2/q2/
fi
got=$(cat .carry-v2/q0/part_0a .carry-v2/q1/part_0b .carry-v2/q1/part_1a .carry-v2/q2/part_1b .carry-v2/q2/part_2 \
      | sha256sum | cut -d' ' -f1)
[ "$got" = "$(cat .carry-v2/q2/payload.sha256)" ] || { echo "the re-cut vLLM payload's sha256 differs: rm -rf .carry-v2"; exit 4; }
echo "vLLM payload: sha256 ok"

if [ ! -f .carry-lmcache/p0/lmc_payload.sha256 ]; then
  echo "== vllm serve extras + LMCache"
  rm -rf .carry-lmcache
  bash scripts/gpu/lmcache/make_payload.sh .carry-lmcache
fi
if ! ls .whl/lmdb-*.whl .whl/zstandard-*.whl >/dev/null 2>&1; then
  echo "== our wheels the image lacks (lmdb, zstandard)"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl lmdb zstandard
fi
if [ "${REDIS:-0}" = 1 ] && [ ! -f .carry-redis/install.sh ]; then
  echo "== redis-server for the fleet rows"
  bash scripts/gpu/redis/make_carry.sh
fi

tree=$(git ls-files -z | xargs -0 cat | wc -c)
bad=0
fits() {  # name, paths...
  local name=$1; shift
  local bytes; bytes=$(( $(du -cb "$@" | tail -1 | cut -f1) + tree ))
  awk -v n="$name" -v b="$bytes" -v t="$tree" 'BEGIN { printf "%-28s %6.1f MiB of 64 (tracked tree %.1f MiB)\n", n, b / 1048576, t / 1048576 }'
  [ "$bytes" -le "$LIMIT" ] || { echo "  too large for one call: trim the tracked tree or cut the payload smaller"; bad=1; }
}
fits "call 1: .carry-v2/q0" .carry-v2/q0
fits "call 2: .carry-v2/q1" .carry-v2/q1
fits "call 3: .carry-v2/q2 .whl" .carry-v2/q2 .whl
fits "call 4: .carry-lmcache/p0" .carry-lmcache/p0
[ -d .carry-redis ] && fits "fleet: .carry-redis" .carry-redis
exit $((bad * 3))
