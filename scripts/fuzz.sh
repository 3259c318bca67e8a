#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets) for SECONDS each (default 600), one after another, niced,
# with cargo-fuzz on nightly Rust (AddressSanitizer on). Each target fuzzes into fuzz/work/TARGET
# (git-ignored), seeded from the committed fuzz/corpus/TARGET; afterwards only the inputs that add
# coverage are merged back into fuzz/corpus/TARGET. A crash stops the script with libFuzzer's report;
# the crashing input is in fuzz/artifacts/TARGET/.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Needs: rustup's nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz --locked`).
# CI runs no libFuzzer: `cargo test -p tandem-fuzz` replays every committed corpus file on stable.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

seconds="${1:-600}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo +nightly fuzz list)
fi

nice -n 19 cargo +nightly fuzz build -O --debug-assertions
for t in "${targets[@]}"; do
  mkdir -p "work/$t" "corpus/$t"
  echo "== $t: ${seconds}s"
  # -timeout: one input taking over 10 s is a finding (a hang); -rss_limit_mb: so is 2 GiB of memory;
  # -max_len: room for a whole tokenizer.json (libFuzzer would otherwise stop at the largest seed).
  nice -n 19 cargo +nightly fuzz run -O --debug-assertions "$t" "work/$t" "corpus/$t" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=16384 -print_final_stats=1
  echo "== $t: merging what adds coverage into corpus/$t"
  nice -n 19 cargo +nightly fuzz run -O --debug-assertions "$t" "corpus/$t" "work/$t" -- -merge=1 2>&1 | grep -E "MERGE-OUTER: [0-9]+ new files" || true
done
