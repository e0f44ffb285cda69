#!/usr/bin/env bash
# Build the SGLang 0.5.17 payload for the GPU machine (Python 3.12, torch 2.11.0+cu130, no network there),
# on a CPU machine that reaches PyPI, from the repo root:
#   bash scripts/gpu/sglang/make_payload.sh [OUTDIR]        (default .carry-sglang-nofa3; .carry-*/ is
#                                                            git-ignored via .git/info/exclude /.carry-*/)
# Output: OUTDIR/p0/sgl_part_0 (.. pN) + sgl_payload.sha256 in the last folder, parts <= 55 MiB. Without
# FlashAttention-3 (the default, WITH_FA3=0) it is one part of ~43 MiB (2026-11-23: 45,495,424 bytes; 252 MB
# unpacked): carry OUTDIR/p0 in ONE device call together with the install (scripts/gpu/sglang/README.md).
# WITH_FA3=1 keeps sgl_kernel's FA3 (flash_ops, 1.1 GB unpacked) and needs 3 parts, one device call each.
#
# Why SGLang 0.5.17: the newest release pinned to the GPU image's torch 2.11.0 (0.5.18+ pin torch 2.13+).
# What is carried and why (found by import probing the engine path, the CUDA branches included, against the
# GPU image's package list in ../.library/device/KINDS.md; 2026-11-23; docs/sglang.md has the story):
#   sglang 0.5.17 (cp312 wheel, unpacked)
#   sglang-kernel 0.4.5 minus FA3 (flash_ops), FlashMLA (flashmla_ops), InfLLM (infllm_ops) and the SM100
#                  ops: a dense or MLA model on Hopper with --attention-backend triton loads only
#                  sgl_kernel/sm90/common_ops (norms, activations, RoPE, the HiCache host<->GPU kernels)
#   transformers 5.12.1, tokenizers 0.22.2   sglang 0.5.17 pins transformers 5.12.1; the image's 5.17.0 fails
#                  at import ("'qwen3_asr' is already used by a Transformers config"), and 5.12.1 requires
#                  tokenizers <= 0.23.0 (the image has 0.23.2)
#   the dependencies the image lacks that the engine path imports (DEPS below): the FastAPI/pydantic stack
#                  (io_struct, tokenizer manager), pyzmq, msgspec, setproctitle, orjson, pybase64, dill, openai
#                  (its protocol types), partial_json_parser + xgrammar + apache-tvm-ffi (function-call parsers
#                  import them at module level), compressed_tensors + loguru and gguf (quantization registry),
#                  uvicorn (engine info bootstrap server), IPython + its dependencies (sglang/utils.py)
#   lmdb, zstandard: tiered_kv's own dependencies the image lacks
# Not carried: FlashInfer (SGLang's sampler imports flashinfer.sampling on CUDA even with the pytorch
# sampling backend: install_on_gpu.sh puts scripts/gpu/sglang/flashinfer_shim there instead, and the
# benchmark sets SGLANG_IS_FLASHINFER_AVAILABLE=false), flash-attn-4, cutlass-dsl, deep-gemm, tilelang,
# outlines/llguidance (grammar_backend none), the multimodal extras.
set -euo pipefail
OUTDIR=${1:-.carry-sglang-nofa3}
WITH_FA3=${WITH_FA3:-0}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
PIPDL="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux1_x86_64 \
  --platform manylinux_2_5_x86_64 --platform any"
mkdir -p "$W/pl/site" "$W/pl/deps" "$W/whl"
$PIPDL -d "$W/whl" sglang==0.5.17 sglang-kernel==0.4.5
# Missing on the GPU image for an offline dummy-weight Engine (import probe, 2026-11-23):
DEPS="transformers==5.12.1 tokenizers==0.22.2 orjson==3.11.5 pybase64==1.4.3 starlette==0.50.0 fastapi==0.128.0
  uvicorn==0.38.0 pydantic==2.12.5 pydantic_core==2.41.5 annotated_types==0.7.0 typing_inspection==0.4.2
  typing_extensions==4.15.0 pyzmq==27.1.0 setproctitle==1.3.7 msgspec==0.20.0 dill==0.4.0 openai==2.6.1
  jiter==0.12.0 distro==1.9.0 sniffio==1.3.1 partial_json_parser==0.2.1.1.post7 xgrammar==0.2.1
  apache_tvm_ffi==0.1.11 compressed_tensors==0.13.0 loguru==0.7.3 gguf==0.17.1
  ipython==9.8.0 ipython_pygments_lexers==1.1.1 traitlets==5.14.3 decorator==5.2.1 jedi==0.19.2 parso==0.8.5
  matplotlib_inline==0.2.1 prompt_toolkit==3.0.52 wcwidth==0.2.14 pexpect==4.9.0 ptyprocess==0.7.0
  stack_data==0.6.3 asttokens==3.0.1 executing==2.2.1 pure_eval==0.2.3
  lmdb==1.7.5 zstandard==0.25.0"
$PIPDL -d "$W/pl/deps" $DEPS
# Every wheel is unpacked here (a wheel is a zip: xz then compresses the sources ~3x better than the wheels' own
# deflate, which is what lets the payload fit in one part); install_on_gpu.sh copies the tree into place.
for whl in "$W"/whl/sglang-0.5.17-*.whl "$W"/whl/sglang_kernel-0.4.5-*.whl "$W"/pl/deps/*.whl; do
  (cd "$W/pl/site" && python3 -m zipfile -e "$whl" .)
done
# A wheel's .data/purelib|platlib belong in site-packages; its scripts/headers/data are not needed here.
for d in "$W"/pl/site/*.data; do
  [ -d "$d" ] || continue
  for lib in purelib platlib; do [ -d "$d/$lib" ] && cp -a "$d/$lib/." "$W/pl/site/"; done
  rm -rf "$d"
done
rm -rf "$W/pl/deps"
# Not loaded by an offline Engine on Hopper with --attention-backend triton: SM100 ops, InfLLM, FlashMLA, the
# Rust HTTP server and the gRPC server native modules (rust_server / grpc modes only), FA3 unless asked for.
rm -rf "$W/pl/site/sgl_kernel/sm100" "$W"/pl/site/sgl_kernel/infllm_ops*.so "$W/pl/site/sgl_kernel/flashmla_ops.abi3.so"
rm -f "$W"/pl/site/sglang/srt/server/_core*.so "$W"/pl/site/sglang/srt/grpc/_core*.so
# Build-time only: xgrammar's static library and headers (62 MB; the Python binding is the .so beside them);
# zstandard's CFFI backend (the C backend is the one imported).
rm -rf "$W/pl/site/xgrammar/lib" "$W/pl/site/xgrammar/include" "$W"/pl/site/zstandard/_cffi*.so
[ "$WITH_FA3" = 1 ] || rm -f "$W/pl/site/sgl_kernel/flash_ops.abi3.so"
find "$W/pl/site" -name "__pycache__" -type d -prune -exec rm -rf {} +
du -sh "$W/pl/site"
mkdir -p "$OUTDIR"
rm -rf "$OUTDIR"/p* "$OUTDIR"/sgl_part_* "$OUTDIR"/sgl_payload.sha256
tar -C "$W" -cf - pl | xz -6 -T0 > "$W/sgl_payload.tar.xz"
sha256sum "$W/sgl_payload.tar.xz" | cut -d' ' -f1 > "$OUTDIR/sgl_payload.sha256"
(cd "$OUTDIR" && split -b 55M -d -a 1 "$W/sgl_payload.tar.xz" sgl_part_)
last=""
for f in "$OUTDIR"/sgl_part_*; do n=${f##*_}; mkdir -p "$OUTDIR/p$n"; mv "$f" "$OUTDIR/p$n/"; last=$n; done
mv "$OUTDIR/sgl_payload.sha256" "$OUTDIR/p$last/"
ls -laR "$OUTDIR"
