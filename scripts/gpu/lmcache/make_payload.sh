#!/usr/bin/env bash
# Build the LMCache 0.5.3 + `vllm serve` extras payload for the GPU machine (Python 3.12, torch 2.11.0+cu130,
# no network there; vLLM 0.26.0 comes from the vLLM recipe in ../shared/tools/vllm-on-gpu).
# Run on a CPU machine that reaches PyPI, from the repo root:
#   bash scripts/gpu/lmcache/make_payload.sh .carry-lmcache        (.carry-*/ must be git-ignored:
#                                                                    .gitignore has /.carry-*/)
# Output: OUTDIR/p0/lmc_part_0 (.. pN) + lmc_payload.sha256 in the last folder, parts <= 60 MiB (today: one
# part, ~34 MB). Carry one folder per device call into /tmp/stage-lmc (scripts/gpu/README.md has the whole
# sequence); scripts/gpu/serve_setup.sh then runs install_on_gpu.sh (this folder) on the GPU machine. A copy
# of the installer also travels in the last folder as install_lmcache_on_gpu.sh (with check_native.py), for use
# without the repo.
# File names differ from the vLLM payload's (part_N, payload.sha256) so both can sit in one stage dir.
#
# What is carried and why (found by import probing against torch 2.11.0+cu130 + the image's package
# list + the vLLM payload, 2026-11-23):
#   lmcache 0.5.3           the peer under test. Its c_ops.so needs 63 torch/c10 symbols, all exported by torch
#                           2.11.0+cu130 (checked with nm against the wheel), libcudart.so.13, sm_90 code; 0.5.6's
#                           cuda_ops.so needs c10::NotImplementedError(SourceLocation, std::string), which 2.11
#                           lacks. It binds natively inside vLLM unless something loaded c_ops.so first under another
#                           module name (pybind11 then refuses the second init): check_native.py
#   aiofile, caio           imported by lmcache.v1.storage_backend (LocalDiskBackend & co) at adapter import
#   cryptography, cffi      imported on LMCache's CUDA path (gds_context -> distributed.serde.aesgcm)
#   pycparser               cffi's declared dependency (not needed at run time; 100 KB insurance)
#   uvicorn, watchfiles, model-hosting-container-standards, jmespath, prometheus-fastapi-instrumentator
#                           `vllm serve` (OpenAI server) imports them; the vLLM payload only covers LLM()
#   lmcache 0.5.1           fallback, installed only with LMC_VERSION=0.5.1 (needs VLLM_KV_CACHE_LAYOUT=HND:
#                           its layout detector predates vLLM 0.26's NHD per-layer tensors)
# Everything else LMCache lists (opentelemetry*, redis, awscrt, google-*, cufile-python, nvtx, blake3,
# setuptools_scm, nixl) is not imported on the in-process CPU/disk offload path. pydantic, pyzmq, msgspec,
# fastapi, starlette come from the vLLM payload (same versions); numpy 2.5.2 / prometheus_client from the
# image (LMCache pins numpy<=2.2.6 and prometheus_client<=0.24.1 but imports fine with the newer ones).
set -euo pipefail
OUTDIR=${1:-.carry-lmcache}
W=$(mktemp -d)
PIPDL="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64 \
  --platform manylinux_2_5_x86_64 --platform any"
mkdir -p "$W/pl/lmc" "$W/pl/serve" "$W/pl/alt" "$W/pl/fallback"
$PIPDL -d "$W/pl/lmc" lmcache==0.5.3 aiofile==3.12.3 caio==0.12.10 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
# caio's binary wheel is manylinux_2_34; its pure-Python wheel is the fallback if the image's glibc is older.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 -d "$W/pl/fallback" caio==0.12.10
$PIPDL -d "$W/pl/serve" uvicorn==0.54.0 watchfiles==1.3.0 model_hosting_container_standards==0.1.16 \
  jmespath==1.1.0 prometheus_fastapi_instrumentator==8.1.0
$PIPDL -d "$W/pl/alt" lmcache==0.5.1
ls -la "$W"/pl/*
mkdir -p "$OUTDIR"
rm -rf "$OUTDIR"/p* "$OUTDIR"/lmc_part_* "$OUTDIR"/lmc_payload.sha256
tar -C "$W" -cf - pl | xz -6 -T0 > "$W/lmc_payload.tar.xz"
sha256sum "$W/lmc_payload.tar.xz" | cut -d' ' -f1 > "$OUTDIR/lmc_payload.sha256"
(cd "$OUTDIR" && split -b 60M -d -a 1 "$W/lmc_payload.tar.xz" lmc_part_)
rm -rf "$W"
last=""
for f in "$OUTDIR"/lmc_part_*; do n=${f##*_}; mkdir -p "$OUTDIR/p$n"; mv "$f" "$OUTDIR/p$n/"; last=$n; done
mv "$OUTDIR/lmc_payload.sha256" "$OUTDIR/p$last/"
# The installer and its check travel with the last part (for use without the repo tree).
cp "$(dirname "$0")/install_on_gpu.sh" "$OUTDIR/p$last/install_lmcache_on_gpu.sh"
cp "$(dirname "$0")/check_native.py" "$OUTDIR/p$last/check_native.py"
ls -laR "$OUTDIR"
