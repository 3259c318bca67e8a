#!/usr/bin/env bash
# Disaggregated against colocated, same workload: starts each configuration with `tandem up`, runs
# `tandem bench serve` against it, stops it, and draws every report into one PNG.
#
#   scripts/serve-compare.sh [BENCH SERVE ARGS...]
#
# Configurations (CONFIGS, space-separated, in this order):
#   colocated  tandem up --colocated: router + one decode node that prefills every prompt itself
#              (the whole memory budget is its own)
#   disagg     tandem up: router + 1 prefill node + 1 decode node (every prompt prefilled on the
#              prefill node, KV moved by the connector: cuda-ipc on one GPU, tcp on the CPU); on one
#              GPU the two nodes split --gpu-memory-utilization
#
# Every argument goes to `tandem bench serve` (workload, rates, SLOs, --backend, --tokenizer ...);
# --label, --output-json, --router and --base-url are set here. Environment (all optional):
#   TANDEM     the tandem binary (default: .device/tandem if present, else target/release/tandem,
#              else target/debug/tandem)
#   UP_ARGS    extra arguments of every `tandem up`, word-split (e.g. "--device cuda
#              --random-weights llama3.1-8b")
#   CONFIGS    which configurations (default "colocated disagg")
#   OUT_DIR    where reports, logs and the plot go (default target/serve-compare)
#   START_TIMEOUT  seconds a configuration may take to start (default 600)
#
# Writes $OUT_DIR/<config>.json, $OUT_DIR/<config>.up.log and $OUT_DIR/serve-compare.png; prints
# each run's table. Exit status 1 if a configuration fails to start or its benchmark fails (the
# others still run), 2 for a bad configuration name.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${TANDEM:-}" ]]; then
    for t in .device/tandem target/release/tandem target/debug/tandem; do
        [[ -x "$t" ]] && { TANDEM=$t; break; }
    done
fi
[[ -x "${TANDEM:-}" ]] || { echo "serve-compare: no tandem binary (build one or set TANDEM)" >&2; exit 1; }
OUT_DIR="${OUT_DIR:-target/serve-compare}"
CONFIGS="${CONFIGS:-colocated disagg}"
START_TIMEOUT="${START_TIMEOUT:-600}"
read -ra UP <<<"${UP_ARGS:-}"
mkdir -p "$OUT_DIR"

for c in $CONFIGS; do
    case "$c" in colocated | disagg) ;; *) echo "serve-compare: unknown configuration '$c' (want colocated or disagg)" >&2; exit 2 ;; esac
done

# A free loopback port.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

up_pid=""
stop_up() {
    if [[ -n "$up_pid" ]] && kill -0 "$up_pid" 2>/dev/null; then
        kill -TERM "$up_pid" 2>/dev/null || true
        for _ in $(seq 1 100); do kill -0 "$up_pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$up_pid" 2>/dev/null || true
        wait "$up_pid" 2>/dev/null || true
    fi
    up_pid=""
}
trap stop_up EXIT

rc=0
reports=()
for c in $CONFIGS; do
    grpc_port=$(free_port)
    http_port=$(free_port)
    extra=()
    [[ "$c" == colocated ]] && extra=(--colocated)
    log="$OUT_DIR/$c.up.log"
    echo "== $c: $TANDEM up ${UP[*]} ${extra[*]}" >&2
    "$TANDEM" up "${UP[@]}" "${extra[@]}" --listen "127.0.0.1:$grpc_port" --http-listen "127.0.0.1:$http_port" >"$log" 2>&1 &
    up_pid=$!
    started=0
    for _ in $(seq 1 $((START_TIMEOUT * 5))); do
        if grep -q "OpenAI API on http://" "$log"; then started=1; break; fi
        kill -0 "$up_pid" 2>/dev/null || break
        sleep 0.2
    done
    if ((started == 0)); then
        echo "serve-compare: $c did not start; its log:" >&2
        tail -20 "$log" >&2
        stop_up
        rc=1
        continue
    fi
    if "$TANDEM" bench serve --label "$c" --output-json "$OUT_DIR/$c.json" \
        --router "127.0.0.1:$grpc_port" --base-url "http://127.0.0.1:$http_port" "$@"; then
        reports+=("$OUT_DIR/$c.json")
    else
        echo "serve-compare: the benchmark of $c failed" >&2
        rc=1
    fi
    stop_up
done

if ((${#reports[@]} > 0)); then
    list=$(IFS=,; echo "${reports[*]}")
    if ! "$TANDEM" bench serve --plot-only --compare "$list" --plot "$OUT_DIR/serve-compare.png"; then
        echo "serve-compare: no plot (the reports are in $OUT_DIR; draw them elsewhere with" \
            "tandem bench serve --plot-only --compare $list --plot serve-compare.png)" >&2
    fi
fi
exit "$rc"
