#!/usr/bin/env bash
# Here (the CPU machine, Debian 12): put Debian's redis-server and redis-cli, with the libraries they link that a
# GPU image may lack, into .carry-redis/ (13 MiB, git-ignored) for one `run` call's carry (scripts/gpu/README.md).
set -euo pipefail
cd "$(dirname "$0")/../../.."
rm -rf .carry-redis && mkdir -p .carry-redis/lib
cp /usr/bin/redis-server /usr/bin/redis-cli .carry-redis/
for bin in /usr/bin/redis-server /usr/bin/redis-cli; do
  # every library but glibc's own (libc, libm, the loader): the GPU image's glibc must be >= this one's
  ldd "$bin" | awk '/=> \//{print $3}' | grep -vE '/(libc|libm|ld-linux[^/]*)\.so' | xargs -r -I{} cp -Lu {} .carry-redis/lib/
done
cp scripts/gpu/redis/install.sh .carry-redis/
(ldd --version || true) 2>&1 | sed -n 1p > .carry-redis/GLIBC_BUILT_AGAINST || true
du -sh .carry-redis
