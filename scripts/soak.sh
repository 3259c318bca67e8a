#!/usr/bin/env bash
# The long soak (issue 17): 10,000 requests of random shapes through etcd + router + 1 prefill + 2
# decode processes on SmolLM2, random client cancellations, a node killed and restarted every 300
# requests; afterwards every node's blocks are free, the surviving processes' memory stayed within
# the bound tests/tests/soak.rs states, and every completed greedy request equals the reference.
# CI runs the same test at its short defaults (160 requests).
#
#   scripts/soak.sh [REQUESTS] [CLIENTS] [KILL_EVERY] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
export TANDEM_SOAK_REQUESTS="${1:-10000}" TANDEM_SOAK_CLIENTS="${2:-8}" TANDEM_SOAK_KILL_EVERY="${3:-300}" TANDEM_SOAK_SEED="${4:-1}"
cargo build --release -p tandem-cli
TANDEM_BIN="$PWD/target/release/tandem" cargo test --release -p tandem-tests --test soak -- --nocapture
