"""CPU <-> disk benchmark (issue 2): raw O_DIRECT vs LMDB values vs our disk tier, same disk, same run.

Usage: python benchmarks/disk_bench.py [--dir /nvme/tmp] [--total-mib 512] [--json out.json]
Same as `tiered-kv bench`. See tiered_kv/cli/bench.py for what is measured.
"""
from tiered_kv.cli.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
