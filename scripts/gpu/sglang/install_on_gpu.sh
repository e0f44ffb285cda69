#!/usr/bin/env bash
# On the GPU machine, from the repo root, after the carried payload parts (make_payload.sh, this folder) were
# copied into $STAGE: reassemble and check the sha256, unpack SGLang 0.5.17 + the slimmed sglang-kernel 0.4.5
# and the carried dependencies into $SITE, put the FlashInfer shim in
# when no real FlashInfer imports, and run check_adapter.py (imports of the engine path, our backend through
# SGLang's dynamic factory, a bit-exact round trip through a real pinned host pool on the GPU).
# The wheels arrive unpacked (make_payload.sh), so this is a copy: no pip, no network.
# Env: STAGE (/tmp/stage), SITE (/tmp/sglang-site), PY (python3). Takes ~30-60 s.
# Then: PYTHONPATH=$SITE:. python3 benchmarks/sglang_ttft.py ...   (scripts/gpu/sglang/README.md)
# Exit: 0 ok; 3 sha mismatch (a part missing: carry every pN folder); 4 copy failed; 5 check_adapter failed.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
STAGE=${STAGE:-/tmp/stage}; SITE=${SITE:-/tmp/sglang-site}; PY=${PY:-python3}
cd "$STAGE" || { echo "no $STAGE"; exit 3; }
want=$(cat sgl_payload.sha256 2>/dev/null)
got=$(cat sgl_part_* | sha256sum | cut -d' ' -f1)
[ -n "$want" ] && [ "$got" = "$want" ] || { echo "payload sha mismatch (have: $(ls sgl_part_* 2>&1))"; exit 3; }
rm -rf x && mkdir x && cat sgl_part_* | xz -dc -T0 | tar -xf - -C x || exit 3
rm -rf "$SITE" && mkdir -p "$SITE"
cp -a x/pl/site/. "$SITE"/ || { echo "copy into $SITE failed"; exit 4; }   # every wheel arrives unpacked
rm -rf x
cd "$REPO"
if ! PYTHONPATH="$SITE" "$PY" -c 'import flashinfer.sampling' 2>/dev/null; then
  cp -a scripts/gpu/sglang/flashinfer_shim/flashinfer "$SITE"/
  echo "flashinfer: not installed; the import-only shim is in $SITE/flashinfer (SGLANG_IS_FLASHINFER_AVAILABLE=false)"
fi
export SGLANG_IS_FLASHINFER_AVAILABLE=false
PYTHONPATH="$SITE:$REPO" "$PY" scripts/gpu/sglang/check_adapter.py || exit 5
echo "SGLang payload installed in $SITE"
