#!/usr/bin/env bash
# Runs the tests of the memory tandem shares with KV transfers under Miri (nightly): the engine's KV
# block store and CPU cache (a transfer thread writing and reading blocks of a layer while the engine
# holds views of it), the paged kernels over block views, and kv-transfer's registered memory (claims,
# safe block accessors). Both aliasing models: Stacked Borrows (the default) and Tree Borrows.
#
# Not here: the attention kernel tests (over 20 minutes under Miri; the engine tests run attention over
# block views), and what Miri cannot run: anything that loads weights (memory maps), sockets (the tcp
# transport, the cluster), FFI (plugins, CUDA), and the long conformance suite.
#
# Usage: scripts/miri.sh. The first run builds the dependencies for Miri (about 10 minutes on 2
# cores); the tests themselves take a few minutes. Not part of scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo +nightly miri --version >/dev/null 2>&1; then
    rustup component add --toolchain nightly miri rust-src
fi
cargo +nightly miri setup

# The engine's tests read model fixtures from disk.
base="-Zmiri-disable-isolation"
for borrows in "" "-Zmiri-tree-borrows"; do
    echo "== engine KV store and kernels under Miri ${borrows:-(stacked borrows)}"
    # Strict provenance: every pointer the tests use keeps the provenance of the store it points into,
    # so Miri checks each access against the engine's references.
    MIRIFLAGS="$base -Zmiri-strict-provenance $borrows" \
        cargo +nightly miri test -p tandem-engine --lib -- model::kv_store model::kv_cache
    MIRIFLAGS="$base -Zmiri-strict-provenance $borrows" \
        cargo +nightly miri test -p tandem-kernels --lib -- cpu::paged
    echo "== kv-transfer registered memory under Miri ${borrows:-(stacked borrows)}"
    # Permissive provenance: block addresses travel as integers (`Iov::addr`, part of the plugin ABI),
    # so here Miri checks bounds, lifetimes and races of block accesses, not aliasing.
    MIRIFLAGS="$base -Zmiri-permissive-provenance $borrows" \
        cargo +nightly miri test -p tandem-kv-transfer --lib -- memory:: geometry::
done
