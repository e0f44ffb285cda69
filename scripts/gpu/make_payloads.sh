#!/usr/bin/env bash
# Build every payload a GPU session carries, on the CPU machine (it reaches the package index), from the repo root:
#   bash scripts/gpu/make_payloads.sh            vLLM 0.26 (cut for the carry limit), `vllm serve` + LMCache, our wheels
#   REDIS=1 bash scripts/gpu/make_payloads.sh    also Debian's redis-server for the fleet rows (.carry-redis)
# A payload already built is kept (delete its folder to rebuild). Output, each folder one device call's carry
# (scripts/gpu/README.md, "Device calls"): .carry-v2/q0 .. qN (the vLLM payload in 32 MiB pieces; the last folder
# also holds its sha256 and install_on_gpu.sh, and travels with .whl), .carry-lmcache/p0 (.. pN).
# The device tool carries at most 64 MiB per call including the working tree it copies (tracked files and untracked
# ones git does not ignore); the last lines check every call's carry against that (exit 3 when one does not fit).
# Needs ../shared/tools/vllm-on-gpu (the shared folder beside the checkout) for the vLLM payload.
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED=${SHARED:-../shared/tools/vllm-on-gpu}
PIECE=$((32 * 1024 * 1024))   # 40 MiB pieces no longer fit beside the 24.3 MiB tree of 2026-11-30: 32 leaves ~7
LIMIT=$((64 * 1024 * 1024))
LMDB_VERSION=3.0.0 ZSTD_VERSION=0.25.0  # what round 10 (2026-11-29) carried

ignored() { git check-ignore -q "$1/" || { echo "$1/ is not git-ignored: add '/.carry-*/' to .gitignore first"; exit 2; }; }
for d in .carry-vllm .carry-v2 .carry-lmcache .whl .carry-redis; do ignored "$d"; done
last_dir() { find "$1" -mindepth 1 -maxdepth 1 -type d -name "$2" | sort -V | tail -1; }

if [ -z "$(last_dir .carry-vllm 'p*' 2>/dev/null)" ] || [ ! -f "$(last_dir .carry-vllm 'p*')/install_on_gpu.sh" ]; then
  [ -f "$SHARED/make_payload.sh" ] || { echo "no $SHARED/make_payload.sh: the vLLM recipe lives in the shared" \
    "folder beside the checkout (../shared/tools/vllm-on-gpu); set SHARED=<that folder>"; exit 2; }
  echo "== vLLM 0.26.0 payload (about a minute)"
  rm -rf .carry-vllm
  bash "$SHARED/make_payload.sh" .carry-vllm
  cp "$SHARED/install_on_gpu.sh" "$(last_dir .carry-vllm 'p*')/"
fi
vlast=$(last_dir .carry-vllm 'p*')
want=$(cat "$vlast/payload.sha256")
if [ ! -f .carry-v2/sha256 ] || [ "$(cat .carry-v2/sha256)" != "$want" ]; then
  echo "== cut into $((PIECE >> 20)) MiB pieces (same bytes, same sha256)"
  rm -rf .carry-v2 && mkdir -p .carry-v2/cut
  # install_on_gpu.sh concatenates part_* in name order: part_00, part_01, ... keep that order
  find .carry-vllm -name 'part_*' -type f | sort -V | xargs cat | split -b "$PIECE" -d -a 2 - .carry-v2/cut/part_
  i=0
  for f in .carry-v2/cut/part_*; do mkdir -p ".carry-v2/q$i"; mv "$f" ".carry-v2/q$i/"; i=$((i + 1)); done
  rmdir .carry-v2/cut
  qlast=$(last_dir .carry-v2 'q*')
  cp "$vlast/payload.sha256" "$vlast/install_on_gpu.sh" "$qlast/"
  echo "$want" > .carry-v2/sha256
fi
got=$(find .carry-v2 -name 'part_*' -type f | sort -V | xargs cat | sha256sum | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "the cut vLLM payload's sha256 differs from the payload's: rm -rf .carry-v2"; exit 4; }
echo "vLLM payload: $(find .carry-v2 -name 'part_*' | wc -l) pieces, sha256 as built"

if [ -z "$(find .carry-lmcache -name lmc_payload.sha256 2>/dev/null)" ]; then
  echo "== vllm serve extras + LMCache"
  rm -rf .carry-lmcache
  bash scripts/gpu/lmcache/make_payload.sh .carry-lmcache
fi
if ! ls .whl/lmdb-"$LMDB_VERSION"-*.whl .whl/zstandard-"$ZSTD_VERSION"-*.whl >/dev/null 2>&1; then
  echo "== our wheels the image lacks (lmdb $LMDB_VERSION, zstandard $ZSTD_VERSION)"
  rm -f .whl/lmdb-*.whl .whl/zstandard-*.whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
    "lmdb==$LMDB_VERSION" "zstandard==$ZSTD_VERSION"
fi
if [ "${REDIS:-0}" = 1 ] && [ ! -f .carry-redis/install.sh ]; then
  echo "== redis-server for the fleet rows"
  bash scripts/gpu/redis/make_carry.sh
fi

# what the device tool copies besides the carry: tracked files as they are now (a deleted one is not there) and
# untracked ones git does not ignore
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
bad=0
fits() {  # label, folders...
  local name=$1; shift
  local bytes; bytes=$(( $(du -cb "$@" | tail -1 | cut -f1) + tree ))
  awk -v n="$name" -v b="$bytes" -v t="$tree" \
    'BEGIN { printf "%-34s %6.1f MiB of 64 (working tree %.1f MiB)\n", n, b / 1048576, t / 1048576 }'
  [ "$bytes" -le "$LIMIT" ] || { echo "  too large for one call: trim the tree or cut the payload smaller"; bad=1; }
}
n=1
qlast=$(last_dir .carry-v2 'q*')
for q in $(find .carry-v2 -mindepth 1 -maxdepth 1 -type d -name 'q*' | sort -V); do
  if [ "$q" = "$qlast" ]; then fits "call $n: $q .whl" "$q" .whl; else fits "call $n: $q" "$q"; fi
  n=$((n + 1))
done
for p in $(find .carry-lmcache -mindepth 1 -maxdepth 1 -type d -name 'p*' | sort -V); do
  fits "call $n: $p" "$p"; n=$((n + 1))
done
if [ -d .carry-redis ]; then fits "fleet rows: .carry-redis" .carry-redis; fi
exit $((bad * 3))
