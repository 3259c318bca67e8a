#!/usr/bin/env bash
# One device call: run the CUDA checks of tandem on the GPU machine.
#
#   scripts/device-check.sh [kernels] [reference] [model] [cluster] [bench]     (default: all)
#
# Expects prebuilt binaries carried in .device/ (build them on the dev machine):
#   .device/tandem                  the CLI
#   .device/tests/cuda_kernels-*    cargo test binary (kernels stage)
#   .device/tests/cuda_engine-*     cargo test binary (model stage)
#
# Stages always run in this order, whatever the order of the arguments:
#   kernels    .device/tests/cuda_kernels-* --include-ignored
#   reference  python3 scripts/reference/cuda_reference.py /tmp/cuda-ref, then
#              TANDEM_CUDA_REF=/tmp/cuda-ref for the later stages
#   model      .device/tests/cuda_engine-* --include-ignored --test-threads=1
#   cluster    tandem up --device cuda --prompt P == tandem generate --device cuda P
#   bench      .device/tandem bench engine --device cuda --hf-python python3
#              --hf-script scripts/reference/hf_offline_bench.py $BENCH_ARGS
#
# Each stage's output goes to the terminal and to $OUT/<stage>.log ($OUT defaults to
# /tmp/device-out). A failed stage does not stop the others; a summary table comes
# last and the exit status is 1 if any stage failed (2 for a bad argument).
#
# Environment knobs (all optional):
#   BENCH_ARGS      extra arguments for `tandem bench engine` (word-split)
#   TEST_SELECT     which tests the test binaries run (default --include-ignored,
#                   i.e. ignored and non-ignored; use --ignored for ignored only)
#   CMD_TIMEOUT     seconds each command may run (via timeout(1)); unset = no limit.
#                   A device call is killed at its own limit (600 s) with no summary,
#                   so set this, or run bench in a call of its own.
#   PYTHON          python for reference/bench (default python3, the torch venv there)
#   CUDA_REF_DIR    where the reference models go (default /tmp/cuda-ref)
set -euo pipefail

export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
export TANDEM_CACHE_DIR=/tmp/tandem-cache
export TANDEM_REPO_ROOT="$PWD"
export PYTHONUNBUFFERED=1

OUT="${OUT:-/tmp/device-out}"
PYTHON="${PYTHON:-python3}"
CUDA_REF_DIR="${CUDA_REF_DIR:-/tmp/cuda-ref}"
TEST_SELECT="${TEST_SELECT:---include-ignored}"
ALL_STAGES=(kernels reference model cluster bench)
mkdir -p "$OUT"

# ---- which stages -----------------------------------------------------------------
declare -A WANT=()
if (($# == 0)); then
    for s in "${ALL_STAGES[@]}"; do WANT[$s]=1; done
fi
for arg in "$@"; do
    case "$arg" in
        kernels | reference | model | cluster | bench) WANT[$arg]=1 ;;
        all) for s in "${ALL_STAGES[@]}"; do WANT[$s]=1; done ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "device-check: unknown stage '$arg' (want: ${ALL_STAGES[*]} or all)" >&2; exit 2 ;;
    esac
done

# ---- helpers ----------------------------------------------------------------------
# run one command, under CMD_TIMEOUT if set
cmd() {
    echo "+ $*" >&2
    if [[ -n "${CMD_TIMEOUT:-}" ]]; then
        timeout -k 10 "$CMD_TIMEOUT" "$@"
    else
        "$@"
    fi
}

# run every cargo test binary matching a glob; fails if none is found or any fails
run_tests() {
    local pattern=$1; shift
    local found=0 rc=0 f
    for f in $pattern; do
        [[ -f "$f" && -x "$f" ]] || continue
        found=1
        cmd "$f" "$@" || rc=$?
    done
    if ((found == 0)); then
        echo "no test binary matches $pattern (carry .device/ with the cargo test binaries)"
        return 1
    fi
    return "$rc"
}

stage_kernels() { run_tests '.device/tests/cuda_kernels-*' "$TEST_SELECT"; }

stage_reference() {
    cmd "$PYTHON" scripts/reference/cuda_reference.py "$CUDA_REF_DIR" || return 1
    local d
    for d in "$CUDA_REF_DIR"/*/; do   # bring the expected values back with the logs
        [[ -f "$d/expected.json" ]] && cp "$d/expected.json" "$OUT/ref-$(basename "$d")-expected.json"
    done
    return 0
}

stage_model() { run_tests '.device/tests/cuda_engine-*' "$TEST_SELECT" --test-threads=1 --nocapture; }

# The cluster on one GPU: `tandem up --device cuda` (prefill node + decode node, KV through the
# CUDA pools' host mirrors over loopback TCP) must print what `tandem generate --device cuda` prints.
stage_cluster() {
    local model="$CUDA_REF_DIR/small" prompt="the quick brown fox jumps over the lazy dog and then"
    [[ -f "$model/config.json" ]] || { echo "no $model: run the reference stage first"; return 1; }
    local gen up t0=$SECONDS
    gen=$(cmd .device/tandem generate --model "$model" --device cuda --max-tokens 24 "$prompt") || return 1
    up=$(cmd .device/tandem up --model "$model" --device cuda --max-tokens 24 --listen 127.0.0.1:0 --prompt "$prompt") || return 1
    up="${up#tandem up: serving on *$'\n'}"   # the address line comes first
    echo "generate + up took $((SECONDS - t0)) s"
    printf 'generate: %q\nup:       %q\n' "$gen" "$up"
    [[ "$gen" == "$up" ]] || { echo "cluster output differs from generate"; return 1; }
    echo "cluster == generate"
}

stage_bench() {
    local extra=()
    read -ra extra <<<"${BENCH_ARGS:-}"
    cmd .device/tandem bench engine --device cuda --hf-python "$PYTHON" \
        --hf-script scripts/reference/hf_offline_bench.py "${extra[@]}"
}

declare -a ROWS=()
FAILED=0
run_stage() {
    local name=$1 log="$OUT/$1.log" rc=0 t0 t1 secs
    echo
    echo "=================== stage $name ($(date -u +%H:%M:%S) UTC) ==================="
    t0=$EPOCHREALTIME
    # errexit does not apply inside a function run under ||, so each stage
    # function returns its own status explicitly.
    "stage_$name" 2>&1 | tee "$log" || rc=$?
    t1=$EPOCHREALTIME
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    if ((rc == 0)); then
        ROWS+=("$(printf '%-10s %-5s %8ss  %s' "$name" PASS "$secs" "$log")")
    else
        FAILED=1
        ROWS+=("$(printf '%-10s %-5s %8ss  %s (exit %d)' "$name" FAIL "$secs" "$log" "$rc")")
    fi
    return "$rc"
}

# ---- run ----------------------------------------------------------------------------
echo "device-check: $(date -u +%Y-%m-%dT%H:%M:%SZ) host=$(hostname) commit=$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
else
    echo "nvidia-smi: not found (no GPU here?)"
fi

if [[ -n "${WANT[kernels]:-}" ]]; then run_stage kernels || true; fi
if [[ -n "${WANT[reference]:-}" ]]; then
    if run_stage reference; then export TANDEM_CUDA_REF="$CUDA_REF_DIR"; fi
fi
# a reference made by an earlier call on the same (still warm) machine also counts
if [[ -z "${TANDEM_CUDA_REF:-}" && -f "$CUDA_REF_DIR/small/expected.json" ]]; then
    export TANDEM_CUDA_REF="$CUDA_REF_DIR"
fi
if [[ -n "${WANT[model]:-}" ]]; then
    echo "TANDEM_CUDA_REF=${TANDEM_CUDA_REF:-<unset>}"
    run_stage model || true
fi
if [[ -n "${WANT[cluster]:-}" ]]; then run_stage cluster || true; fi
if [[ -n "${WANT[bench]:-}" ]]; then run_stage bench || true; fi

echo
echo "=================== summary ==================="
printf '%-10s %-5s %9s  %s\n' stage result time log
for row in "${ROWS[@]}"; do echo "$row"; done
if ((FAILED)); then
    echo "device-check: FAILED"
    exit 1
fi
echo "device-check: all selected stages passed"
