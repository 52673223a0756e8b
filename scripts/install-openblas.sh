#!/bin/sh
# Best effort: install Debian's OpenBLAS (libopenblas0-pthread) when it is missing, so MLX's CPU
# matmul can be preloaded with it (~40x faster). Never fails: without it MLX uses its own BLAS.
set -u
[ "$(uname -s)" = Linux ] || exit 0
[ -n "$(sh "$(dirname "$0")/blas-preload.sh")" ] && exit 0
command -v apt-get >/dev/null 2>&1 || { echo "openblas: no apt-get here; using MLX's own BLAS"; exit 0; }
if [ "$(id -u)" != 0 ]; then
    echo "openblas: not root; for ~40x faster CPU matmul run: sudo apt-get install libopenblas0-pthread"
    exit 0
fi
echo "openblas: installing libopenblas0-pthread (MLX's CPU matmul is ~40x faster with it)"
{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends libopenblas0-pthread; } >/dev/null 2>&1 \
    || echo "openblas: could not install libopenblas0-pthread; using MLX's own BLAS (slower)"
exit 0
