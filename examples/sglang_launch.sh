#!/usr/bin/env bash
# Launch SGLang with tiered_kv as its HiCache L3 storage backend (no patch to SGLang).
# Needs SGLang 0.5.23 and tiered_kv installed in the same environment, and a GPU.
# Usage: examples/sglang_launch.sh MODEL [/nvme/kv]
set -euo pipefail
MODEL=${1:?usage: $0 MODEL [DISK_PATH]}
DISK=${2:-/tmp/tiered-kv-sglang}
exec python -m sglang.launch_server --model-path "$MODEL" --page-size 64 \
  --enable-hierarchical-cache --hicache-ratio 2 --hicache-mem-layout page_first \
  --hicache-write-policy write_through --hicache-storage-prefetch-policy timeout \
  --hicache-storage-backend dynamic \
  --hicache-storage-backend-extra-config "{\"backend_name\":\"tiered_kv\",\"module_path\":\"tiered_kv.connector.sglang\",\"class_name\":\"TieredHiCacheStorage\",\"interface_v1\":1,\"hicache_storage_pass_prefix_keys\":true,\"disk_path\":\"$DISK\",\"disk_bytes\":\"1TiB\"}"
