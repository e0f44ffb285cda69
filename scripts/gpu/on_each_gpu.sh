#!/usr/bin/env bash
# Run one command per GPU of a several-GPU machine at once (issue 14: more engine starts per device minute).
#
#   scripts/gpu/on_each_gpu.sh 'CMD for GPU 0' 'CMD for GPU 1' ...
#
# Command i runs under bash with CUDA_VISIBLE_DEVICES=i (CUDA_DEVICE_ORDER=PCI_BUS_ID, so CUDA's and
# nvidia-smi's numbering agree) and OUT=$OUT/g<i> (created), its stdout and stderr in $OUT/g<i>/log.txt.
# Write `$OUT` inside single quotes so that each command sees its own folder. Starts are STAGGER_S
# (default 10) seconds apart so that engines do not pick ports and load weights in the same second.
# When all have ended it prints each log's last TAIL (default 40) lines without vLLM's and LMCache's
# INFO/DEBUG lines, packs every g<i>/ folder into $OUT/gpus.tgz and removes the folders (the device
# tool brings back at most 8 files a call; PACK=0 keeps the folders as they are), and exits with the
# largest exit status. Engines on one host share its host link (4 H200s, 2026-11-28: 38 GB/s each when
# all four copy at once against 55 alone, benchmarks/probes/neighbor_probe.py): run it before such a
# run, and don't put numbers from runs that shared the link beside those of a lone engine.
set -u
if [ $# -eq 0 ]; then
    echo "usage: $0 'CMD for GPU 0' ['CMD for GPU 1' ...]" >&2
    exit 2
fi
ngpu=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
if [ "$#" -gt "$ngpu" ]; then
    echo "on_each_gpu.sh: $# commands but $ngpu GPU(s) here; give at most one command per GPU" >&2
    exit 2
fi
root=${OUT:-$PWD/out}
pids=()
i=0
for cmd in "$@"; do
    dir="$root/g$i"
    mkdir -p "$dir"
    echo "[on_each_gpu] GPU $i: $cmd" | tee "$dir/log.txt"
    CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=$i OUT=$dir bash -c "$cmd" >>"$dir/log.txt" 2>&1 &
    pids+=($!)
    i=$((i + 1))
    [ "$i" -lt "$#" ] && sleep "${STAGGER_S:-10}"
done
worst=0
for j in "${!pids[@]}"; do
    wait "${pids[$j]}"
    rc=$?
    echo "[on_each_gpu] GPU $j exit $rc" >>"$root/g$j/log.txt"
    [ "$rc" -gt "$worst" ] && worst=$rc
done
for j in "${!pids[@]}"; do
    echo "===== GPU $j ====="
    grep -v -e "LMCache INFO" -e "INFO 1[0-9]-" -e "DEBUG" "$root/g$j/log.txt" | tail -n "${TAIL:-40}"
done
if [ "${PACK:-1}" = 1 ]; then
    (cd "$root" && tar czf gpus.tgz --exclude='*.partial.json' g[0-9]* && rm -rf g[0-9]*) \
        && echo "[on_each_gpu] packed into $root/gpus.tgz (tar xzf gpus.tgz)"
fi
exit "$worst"
