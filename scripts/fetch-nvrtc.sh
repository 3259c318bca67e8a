#!/usr/bin/env bash
# Fetches NVRTC (the CUDA run-time compiler) without a CUDA toolkit or GPU, so CI can check that
# every kernel in kernels/cuda/ compiles (kernels/tests/nvrtc_compile.rs).
#
# Downloads the PyPI wheel nvidia-cuda-nvrtc (pinned to the device machines' CUDA 13.0), unpacks
# libnvrtc.so.13 and libnvrtc-builtins*.so* into target/nvrtc/lib, and prints that absolute
# directory as the LAST line of stdout. Idempotent: a second run downloads nothing.
#
#   LD_LIBRARY_PATH=$(scripts/fetch-nvrtc.sh | tail -1) cargo test -p tandem-kernels --release --test nvrtc_compile
set -euo pipefail

VERSION="13.0.88"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="$ROOT/target/nvrtc"
WHEEL_DIR="$BASE/wheel"
LIB_DIR="$BASE/lib"
STAMP="$LIB_DIR/.version"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$VERSION" ]] && compgen -G "$LIB_DIR/libnvrtc.so.*" >/dev/null; then
    echo "$LIB_DIR"
    exit 0
fi

mkdir -p "$WHEEL_DIR" "$LIB_DIR"
if ! compgen -G "$WHEEL_DIR/nvidia_cuda_nvrtc-$VERSION-*.whl" >/dev/null; then
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
        --python-version 3 --implementation py \
        "nvidia-cuda-nvrtc==$VERSION" -d "$WHEEL_DIR" >&2
fi
WHEEL="$(compgen -G "$WHEEL_DIR/nvidia_cuda_nvrtc-$VERSION-*.whl" | head -1)"

# Unpack only the shared libraries, flattened into LIB_DIR (python's zipfile: no unzip needed).
python3 - "$WHEEL" "$LIB_DIR" <<'PY'
import os, re, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
found = []
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        base = os.path.basename(name)
        if re.match(r"libnvrtc(-builtins)?\.so(\.|$)", base):
            tmp = os.path.join(out, base + ".tmp")
            with z.open(name) as src, open(tmp, "wb") as dst:
                dst.write(src.read())
            os.chmod(tmp, 0o755)
            os.replace(tmp, os.path.join(out, base))
            found.append(base)
if not any(f.startswith("libnvrtc.so") for f in found):
    sys.exit(f"no libnvrtc.so* in {wheel}")
print("unpacked: " + " ".join(sorted(found)), file=sys.stderr)
PY

# cudarc looks for libnvrtc.so.13 (and libnvrtc.so); make sure both names resolve.
if [[ ! -e "$LIB_DIR/libnvrtc.so" ]]; then
    ln -sf "$(basename "$(compgen -G "$LIB_DIR/libnvrtc.so.*" | head -1)")" "$LIB_DIR/libnvrtc.so"
fi
echo "$VERSION" >"$STAMP"
echo "$LIB_DIR"
