#!/bin/sh
# Print the path of Debian's OpenBLAS (pthread) libblas.so.3, or nothing.
#
# MLX's Linux CPU wheel links a slow reference BLAS; LD_PRELOADing OpenBLAS's
# libblas.so.3 makes matmul ~40x faster. Printing nothing means "use MLX's own
# BLAS" (macOS, non-Debian Linux, or libopenblas0-pthread not installed).
set -u

[ "$(uname -s)" = Linux ] || exit 0

# Ask dpkg first: it knows the real path on any Debian/Ubuntu architecture.
if command -v dpkg >/dev/null 2>&1; then
    lib=$(dpkg -L libopenblas0-pthread 2>/dev/null | grep '/libblas\.so\.3$' | head -n 1)
    if [ -n "$lib" ] && [ -r "$lib" ]; then
        echo "$lib"
        exit 0
    fi
fi

# Fall back to the usual multiarch paths. Only this machine's architecture:
# preloading a foreign-arch library makes ld.so complain on every exec.
for lib in \
    "/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3" \
    /usr/lib/openblas-pthread/libblas.so.3; do
    if [ -r "$lib" ]; then
        echo "$lib"
        exit 0
    fi
done
exit 0
