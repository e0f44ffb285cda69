#!/usr/bin/env bash
# On the GPU machine, after carrying .carry-redis: wrappers in /tmp/redis/bin that run the carried redis-server and
# redis-cli with their own libraries (LD_LIBRARY_PATH for those two programs only, never for Python).
# Then: export PATH=/tmp/redis/bin:$PATH  (benchmarks/vllm_ttft.py's tiered-remote* modes start a cluster with them)
set -euo pipefail
src="$(cd "$(dirname "$0")" && pwd)"
mkdir -p /tmp/redis/bin /tmp/redis/lib
cp "$src"/redis-server "$src"/redis-cli /tmp/redis/ && cp "$src"/lib/* /tmp/redis/lib/
for p in redis-server redis-cli; do
  printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/redis/lib exec /tmp/redis/%s "$@"\n' "$p" > /tmp/redis/bin/$p
  chmod +x /tmp/redis/bin/$p /tmp/redis/$p
done
echo "glibc here: $( (ldd --version || true) 2>&1 | sed -n 1p); carried binaries built against: $(cat "$src"/GLIBC_BUILT_AGAINST)"
/tmp/redis/bin/redis-server --version
