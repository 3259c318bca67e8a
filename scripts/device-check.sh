#!/usr/bin/env bash
# One device call: run the CUDA checks of tandem on the GPU machine.
#
#   scripts/device-check.sh [kernels] [reference] [model] [cluster] [kv] [cluster2] [disagg] [serve] [bench]
#                                                                     (default: all)
#
# Expects prebuilt binaries carried in .device/ (build them on the dev machine):
#   .device/tandem                  the CLI
#   .device/tests/cuda_kernels-*    cargo test binary (kernels stage)
#   .device/tests/cuda_engine-*     cargo test binary (model stage)
#   .device/etcd                    etcd (Debian's etcd-server binary; cluster2 stage)
#
# Stages always run in this order, whatever the order of the arguments:
#   kernels    .device/tests/cuda_kernels-* --include-ignored
#   reference  python3 scripts/reference/cuda_reference.py /tmp/cuda-ref, then
#              TANDEM_CUDA_REF=/tmp/cuda-ref for the later stages
#   model      .device/tests/cuda_engine-* --include-ignored --test-threads=1
#   cluster    tandem up --device cuda --prompt P == tandem generate --device cuda P (the
#              embedded nodes' KV goes device to device through cuda-ipc, `auto`), and the
#              same with --kv-connector tcp (through the host mirrors)
#   kv         tandem kv conformance cuda-ipc --device cuda:0 (the suite over device memory),
#              tandem bench kv --backend cuda-ipc --device cuda:0 (against a raw D2D copy), both
#              again receiver-driven (TANDEM_KV_NO_SENDER_WRITES=1), and the TANDEM_KV_TRACE
#              timeline of one 256 MiB transfer
#   cluster2   etcd + router + prefill + decode as separate processes sharing the GPU with
#              --kv-connector cuda-ipc: client output == generate; a chunk corrupted in flight
#              (TANDEM_KV_TEST_CORRUPT_CHUNK) is caught and the request served by local
#              prefill; a prefill node killed mid-request still leaves a correct answer
#   disagg     tandem bench disagg --device cuda (TTFT through the cluster against the engine
#              alone, and 256 clients against the engine's offline throughput) $DISAGG_ARGS
#   serve      scripts/serve-compare.sh: tandem up --device cuda --random-weights llama3.1-8b
#              colocated (the decode node alone prefills everything) and disaggregated (1 prefill +
#              1 decode node sharing the GPU, KV through cuda-ipc), the same `tandem bench serve`
#              Poisson sweep against each ($SERVE_ARGS replaces the default workload); reports,
#              logs and serve-compare.png in $OUT/serve/
#   bench      .device/tandem bench engine --device cuda --hf-python python3
#              --hf-script scripts/reference/hf_offline_bench.py $BENCH_ARGS
#
# Two-GPU stages (a machine of two GPUs, e.g. nvidia-h200-x2; not in the default set, not in `all`;
# name them, or `gpus` for all four):
#   gpus_kv       the nccl test binary's two-GPU tests (.device/tests/nccl-* --ignored), the
#                 conformance suite for nccl and cuda-ipc with senders on cuda:0 and receivers on
#                 cuda:1, and tandem bench kv for both across the GPUs (1, 16, 256 MiB) next to a
#                 bare NCCL send and cudaMemcpyPeer of the same bytes; nccl again
#                 in announced batches (TANDEM_KV_NCCL_NO_AHEAD=1) and staged (also
#                 TANDEM_KV_NCCL_STAGED=1: conformance and bench); cuda-ipc again receiver-driven
#                 (TANDEM_KV_NO_SENDER_WRITES=1: conformance and bench) and with pulls (also
#                 TANDEM_KV_NO_PUSH=1), the timeline of one traced 256 MiB transfer of each backend,
#                 and both backends again with the receivers in a second process (--two-processes)
#   gpus_cluster  with --kv-connector nccl and then cuda-ipc: tandem up --devices cuda:0,cuda:1
#                 == generate; etcd + router + prefill node on cuda:0 + decode node on cuda:1 as
#                 processes: client output == generate; a prefill node
#                 killed mid-transfer (transfers paced by TANDEM_KV_TEST_CHUNK_DELAY_MS, the kill
#                 once its first chunk left: with nccl the link's communicators made) leaves a
#                 correct answer, every decode block free, and no memory of it on cuda:0, and a
#                 new prefill node then transfers into the same decode node (the decode node's GPU
#                 memory reported after each); $GPUS_CLUSTER_BACKENDS picks the backends,
#                 $GPUS_CLUSTER_KILLS repeats the kill and the new node
#   gpus_disagg   tandem bench disagg --devices cuda:0,cuda:1 (TTFT of a 2,048-token prompt of the
#                 8B geometry through the cluster against prefill alone) $DISAGG_ARGS
#   gpus_serve    scripts/serve-compare.sh with tandem up --devices cuda:0,cuda:1: two colocated
#                 decode nodes (one per GPU) against 1 prefill (cuda:0) + 1 decode (cuda:1), the same
#                 `tandem bench serve` sweep ($SERVE_ARGS); reports and plot in $OUT/gpus_serve/
#
# Each stage's output goes to the terminal and to $OUT/<stage>.log ($OUT defaults to
# /tmp/device-out). A failed stage does not stop the others; a summary table comes
# last and the exit status is 1 if any stage failed (2 for a bad argument).
#
# Environment knobs (all optional):
#   BENCH_ARGS      extra arguments for `tandem bench engine` (word-split)
#   SERVE_ARGS      the `tandem bench serve` workload of the serve stage (word-split; default
#                   --request-rate 2,4,8,16,32 --num-prompts 100 --input-len 1024 --output-len 128
#                   --slo-ttft-ms 300 --slo-itl-ms 30)
#   SERVE_UP_ARGS   extra arguments of both `tandem up`s of the serve stage (word-split)
#   TEST_SELECT     which tests the test binaries run, word-split (default --include-ignored,
#                   e.g. "--ignored ipc" runs the ignored tests whose names contain ipc;
#                   i.e. ignored and non-ignored; use --ignored for ignored only)
#   CMD_TIMEOUT     seconds each command may run (via timeout(1)); unset = no limit.
#                   A device call is killed at its own limit (600 s) with no summary,
#                   so set this, or run bench in a call of its own.
#   PYTHON          python for reference/bench (default python3, the torch venv there)
#   REF_ARGS        extra arguments of the reference script (e.g. "--only small": the cluster
#                   stages need only that model)
#   CUDA_REF_DIR    where the reference models go (default /tmp/cuda-ref)
set -euo pipefail

export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 NCCL_MAX_P2P_NCHANNELS=${NCCL_MAX_P2P_NCHANNELS:-16}
export TANDEM_CACHE_DIR=/tmp/tandem-cache
export TANDEM_REPO_ROOT="$PWD"
export PYTHONUNBUFFERED=1

OUT="${OUT:-/tmp/device-out}"
PYTHON="${PYTHON:-python3}"
CUDA_REF_DIR="${CUDA_REF_DIR:-/tmp/cuda-ref}"
TEST_SELECT="${TEST_SELECT:---include-ignored}"
ALL_STAGES=(kernels reference model cluster kv cluster2 disagg serve bench)
GPUS_STAGES=(gpus_kv gpus_cluster gpus_disagg gpus_serve)
mkdir -p "$OUT"

# ---- which stages -----------------------------------------------------------------
declare -A WANT=()
if (($# == 0)); then
    for s in "${ALL_STAGES[@]}"; do WANT[$s]=1; done
fi
for arg in "$@"; do
    case "$arg" in
        kernels | reference | model | cluster | kv | cluster2 | disagg | serve | bench) WANT[$arg]=1 ;;
        gpus_kv | gpus_cluster | gpus_disagg | gpus_serve) WANT[$arg]=1 ;;
        all) for s in "${ALL_STAGES[@]}"; do WANT[$s]=1; done ;;
        gpus) for s in "${GPUS_STAGES[@]}"; do WANT[$s]=1; done ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "device-check: unknown stage '$arg' (want: ${ALL_STAGES[*]} ${GPUS_STAGES[*]}, all or gpus)" >&2; exit 2 ;;
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

read -ra SELECT <<<"$TEST_SELECT"
stage_kernels() { run_tests '.device/tests/cuda_kernels-*' "${SELECT[@]}"; }

stage_reference() {
    local only=()
    read -ra only <<<"${REF_ARGS:-}"
    cmd "$PYTHON" scripts/reference/cuda_reference.py "$CUDA_REF_DIR" "${only[@]}" || return 1
    local d
    for d in "$CUDA_REF_DIR"/*/; do   # bring the expected values back with the logs
        [[ -f "$d/expected.json" ]] && cp "$d/expected.json" "$OUT/ref-$(basename "$d")-expected.json"
    done
    return 0
}

stage_model() { run_tests '.device/tests/cuda_engine-*' "${SELECT[@]}" --test-threads=1 --nocapture; }

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
    echo "cluster (cuda-ipc) == generate"
    up=$(cmd .device/tandem up --model "$model" --device cuda --kv-connector tcp --max-tokens 24 --listen 127.0.0.1:0 --prompt "$prompt") || return 1
    up="${up#tandem up: serving on *$'\n'}"
    [[ "$gen" == "$up" ]] || { printf 'tcp:      %q\n' "$up"; echo "cluster over tcp differs from generate"; return 1; }
    echo "cluster (tcp through the host mirrors) == generate"
}

stage_kv() {
    cmd .device/tandem kv conformance cuda-ipc --device cuda:0 || return 1
    cmd .device/tandem bench kv --backend cuda-ipc --device cuda:0 --latency-iters 200 || return 1
    # the receiver moving every payload itself (protocol 3's way), for comparison in the same call
    echo "---- cuda-ipc on one GPU, receiver-driven (TANDEM_KV_NO_SENDER_WRITES=1)"
    TANDEM_KV_NO_SENDER_WRITES=1 cmd .device/tandem kv conformance cuda-ipc --device cuda:0 || return 1
    TANDEM_KV_NO_SENDER_WRITES=1 cmd .device/tandem bench kv --backend cuda-ipc --device cuda:0 --latency-iters 50 || return 1
    echo "---- cuda-ipc on one GPU, TANDEM_KV_TRACE=1, 256 MiB"
    TANDEM_KV_TRACE=1 cmd .device/tandem bench kv --backend cuda-ipc --device cuda:0 --sizes 256 --iters 1 --latency-iters 1 \
        > /tmp/kv_trace.txt 2>&1 || return 1
    last_transfer_trace /tmp/kv_trace.txt 256
}

# Starts `tandem ARGS...` in the background with its output in $OUT/NAME.log and waits for its
# "serving on ADDR" line; prints ADDR. The pid goes to $DIR/NAME.pid.
start_bg() {
    local name=$1; shift
    TANDEM_LOG="${TANDEM_LOG:-info}" .device/tandem "$@" >"$OUT/$name.log" 2>&1 &
    echo $! >"$DIR/$name.pid"
    local i addr
    for ((i = 0; i < 600; i++)); do
        addr=$(sed -n 's/^tandem [a-z]* serving on //p' "$OUT/$name.log" | head -1)
        [[ -n "$addr" ]] && { echo "$addr"; return 0; }
        kill -0 "$(cat "$DIR/$name.pid")" 2>/dev/null || { echo "$name exited:" >&2; tail -20 "$OUT/$name.log" >&2; return 1; }
        sleep 0.1
    done
    echo "$name did not start in 60 s" >&2
    return 1
}

stop_bg() { [[ -f "$DIR/$1.pid" ]] && kill -9 "$(cat "$DIR/$1.pid")" 2>/dev/null; rm -f "$DIR/$1.pid"; return 0; }

# Starts .device/etcd in a fresh $DIR, clients on 127.0.0.1:PORT, peers on PEER_PORT, its output in
# $OUT/LOG; waits (up to 10 s) until the client port accepts.
start_etcd() {
    local port=$1 peer=$2 log=$3 i
    DIR=$(mktemp -d)
    .device/etcd --data-dir "$DIR/etcd" --listen-client-urls "http://127.0.0.1:$port" \
        --advertise-client-urls "http://127.0.0.1:$port" --listen-peer-urls "http://127.0.0.1:$peer" >"$OUT/$log" 2>&1 &
    echo $! >"$DIR/etcd.pid"
    for ((i = 0; i < 100; i++)); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        sleep 0.1
    done
}

stage_cluster2() {
    local model="$CUDA_REF_DIR/small"
    [[ -f "$model/config.json" ]] || { echo "no $model: run the reference stage first"; return 1; }
    [[ -x .device/etcd ]] || { echo "no .device/etcd (copy Debian's /usr/bin/etcd there)"; return 1; }
    start_etcd 23791 23801 etcd.log
    local rc=0
    cluster2_body || rc=$?
    for p in client router prefill decode etcd; do stop_bg "$p"; done
    return "$rc"
}

cluster2_body() {
    local model="$CUDA_REF_DIR/small" etcd=http://127.0.0.1:23791 router prompt gen got
    # --gpu-memory-utilization counts what is in use already: the first node takes 0.3 of the GPU,
    # the next one up to 0.6 (i.e. the rest of its 0.3), a restarted prefill node likewise.
    local node=(--etcd "$etcd" --ttl 2 --model "$model" --device cuda --kv-connector cuda-ipc)
    router=$(start_bg router router --etcd "$etcd" --listen 127.0.0.1:0) || return 1
    start_bg prefill prefill "${node[@]}" --gpu-memory-utilization 0.3 >/dev/null || return 1
    start_bg decode decode "${node[@]}" --gpu-memory-utilization 0.6 --local-prefill-below 0 >/dev/null || return 1
    sleep 1
    prompt="the quick brown fox jumps over the lazy dog and then runs far away into the forest"
    gen=$(cmd .device/tandem generate --model "$model" --device cuda --max-tokens 24 "$prompt") || return 1
    got=$(cmd .device/tandem client --router "$router" --max-tokens 24 "$prompt" 2>/dev/null) || return 1
    printf 'generate: %q\nclient:   %q\n' "$gen" "$got"
    [[ "$gen" == "$got" ]] || { echo "two-process cluster output differs from generate"; return 1; }
    grep -q "first KV transfer" "$OUT/prefill.log" || { echo "no transfer logged by the prefill node"; return 1; }
    grep "first KV transfer" "$OUT/prefill.log" | tail -1
    grep -q 'backend.*cuda-ipc\|cuda-ipc' "$OUT/prefill.log" || { echo "the prefill node did not use cuda-ipc"; return 1; }
    echo "two processes on one GPU over cuda-ipc == generate"

    # A chunk corrupted in flight: caught by the receiver's device checksum, served by local prefill.
    stop_bg prefill
    TANDEM_KV_TEST_CORRUPT_CHUNK=1 start_bg prefill prefill "${node[@]}" --gpu-memory-utilization 0.6 >/dev/null || return 1
    sleep 3
    prompt="a completely different prompt about rivers, mountains and the weather in spring time"
    gen=$(cmd .device/tandem generate --model "$model" --device cuda --max-tokens 24 "$prompt") || return 1
    got=$(cmd .device/tandem client --router "$router" --max-tokens 24 "$prompt" 2>/dev/null) || return 1
    [[ "$gen" == "$got" ]] || { printf 'generate: %q\nclient:   %q\n' "$gen" "$got"; echo "corrupted transfer: wrong output"; return 1; }
    grep -q "checksum mismatch" "$OUT/decode.log" || { echo "the decode node did not report the corrupted chunk"; tail -20 "$OUT/decode.log"; return 1; }
    grep -q "prefilling locally" "$OUT/decode.log" || { echo "the decode node did not fall back"; return 1; }
    echo "corrupted chunk caught (checksum mismatch), request served by local prefill, output == generate"

    # A prefill node killed while it works: the request still completes correctly.
    stop_bg prefill
    start_bg prefill prefill "${node[@]}" --gpu-memory-utilization 0.6 >/dev/null || return 1
    sleep 3
    prompt=$(for i in $(seq 1 120); do printf 'sentence %d of a long document about ships. ' "$i"; done)
    gen=$(cmd .device/tandem generate --model "$model" --device cuda --max-tokens 16 "$prompt") || return 1
    .device/tandem client --router "$router" --max-tokens 16 "$prompt" >"$DIR/killed.out" 2>"$OUT/client.log" &
    echo $! >"$DIR/client.pid"
    sleep 0.2
    stop_bg prefill
    wait "$(cat "$DIR/client.pid")" || { echo "the client failed after the prefill node died"; cat "$OUT/client.log"; return 1; }
    rm -f "$DIR/client.pid"
    got=$(cat "$DIR/killed.out")
    [[ "$gen" == "$got" ]] || { printf 'generate: %q\nclient:   %q\n' "$gen" "$got"; echo "prefill killed: wrong output"; return 1; }
    echo "prefill node killed mid-request: output == generate"
    got=$(cmd .device/tandem client --router "$router" --max-tokens 8 "still serving?" 2>/dev/null) || return 1
    echo "the decode node still serves: $got"
    gen=$(cmd .device/tandem generate --model "$model" --device cuda --max-tokens 16 "$(after_kill_prompt)") || return 1
    after_kill "$gen" "" "${node[@]}" --gpu-memory-utilization 0.6
}

# A prefill node started after one was killed mid-transfer: its transfers into the same decode node
# work again (nothing the killed sender left — its mapping, its write events — holds up the decode
# node's verification). $1: what `tandem generate` answers to `after_kill_prompt $2` (16 tokens);
# prefill node flags in the rest; the cluster's router in $router.
after_kill_prompt() { for i in $(seq 1 60); do printf 'note %d on the bridges of a river town%s. ' "$i" "${1:-}"; done; }
after_kill() {
    local gen=$1 tag=$2 got; shift 2
    start_bg prefill prefill "$@" >/dev/null || return 1
    sleep 3
    got=$(cmd .device/tandem client --router "$router" --max-tokens 16 "$(after_kill_prompt "$tag")" 2>/dev/null) || return 1
    [[ "$gen" == "$got" ]] || { printf 'generate: %q\nclient:   %q\n' "$gen" "$got"; echo "after the kill: wrong output"; return 1; }
    grep "first KV transfer" "$OUT/prefill.log" | tail -1
    grep -q "first KV transfer" "$OUT/prefill.log" || { echo "the prefill node started after the kill transferred nothing"; return 1; }
    echo "a prefill node started after the kill transfers into the same decode node: output == generate"
}

stage_disagg() {
    local extra=()
    read -ra extra <<<"${DISAGG_ARGS:-}"
    cmd .device/tandem bench disagg --device cuda "${extra[@]}"
}

stage_serve() {
    local workload=()
    read -ra workload <<<"${SERVE_ARGS:---request-rate 2,4,8,16,32 --num-prompts 100 --input-len 1024 --output-len 128 --slo-ttft-ms 300 --slo-itl-ms 30}"
    TANDEM=.device/tandem OUT_DIR="$OUT/serve" START_TIMEOUT=300 \
        UP_ARGS="--device cuda --random-weights llama3.1-8b ${SERVE_UP_ARGS:-}" \
        cmd scripts/serve-compare.sh --tokenizer tests/fixtures/tiny/llama "${workload[@]}"
}

stage_bench() {
    local extra=()
    read -ra extra <<<"${BENCH_ARGS:-}"
    cmd .device/tandem bench engine --device cuda --hf-python "$PYTHON" \
        --hf-script scripts/reference/hf_offline_bench.py "${extra[@]}"
}

# ---- two GPUs -------------------------------------------------------------------------
# The TANDEM_KV_TRACE timeline of the last transfer of N blocks in FILE (its start to its
# completion on the receiver).
last_transfer_trace() {
    local file=$1 blocks=$2 id
    id=$(grep "start ($blocks blocks)" "$file" | tail -n 1 | awk '{print $5}')
    [[ -n "$id" ]] || { echo "no traced transfer of $blocks blocks in $file"; return 0; }
    awk -v id="$id" '$0 ~ "tx " id " start" {on=1} on {print} on && $0 ~ "rx " id " complete" {exit}' "$file"
}

stage_gpus_kv() {
    local rc=0
    # the conformance cases run below through the CLI; the binary's other two-GPU tests here
    run_tests '.device/tests/nccl-*' --ignored --skip conformance_gpu0_to_gpu1 --test-threads=1 || rc=1
    cmd .device/tandem kv conformance nccl --device cuda:0,cuda:1 || rc=1
    cmd .device/tandem kv conformance cuda-ipc --device cuda:0,cuda:1 || rc=1
    cmd .device/tandem bench kv --backend nccl --device cuda:0,cuda:1 --latency-iters 200 || rc=1
    # granted transfers in announced batches too (control protocol v4's direct sends), and every
    # batch through the staging buffers (gather, one send, scatter): each path of the backend
    # passes conformance, and is measured for comparison in the same call
    echo "---- nccl, announced batches (TANDEM_KV_NCCL_NO_AHEAD=1)"
    TANDEM_KV_NCCL_NO_AHEAD=1 cmd .device/tandem kv conformance nccl --device cuda:0,cuda:1 || rc=1
    TANDEM_KV_NCCL_NO_AHEAD=1 cmd .device/tandem bench kv --backend nccl --device cuda:0,cuda:1 --latency-iters 50 || rc=1
    echo "---- nccl, staged (TANDEM_KV_NCCL_NO_AHEAD=1 TANDEM_KV_NCCL_STAGED=1)"
    TANDEM_KV_NCCL_NO_AHEAD=1 TANDEM_KV_NCCL_STAGED=1 cmd .device/tandem kv conformance nccl --device cuda:0,cuda:1 || rc=1
    TANDEM_KV_NCCL_NO_AHEAD=1 TANDEM_KV_NCCL_STAGED=1 cmd .device/tandem bench kv --backend nccl --device cuda:0,cuda:1 --latency-iters 50 || rc=1
    echo "---- nccl, TANDEM_KV_TRACE=1, 256 MiB"
    TANDEM_KV_TRACE=1 cmd .device/tandem bench kv --backend nccl --device cuda:0,cuda:1 --sizes 256 --iters 1 --latency-iters 1 \
        > /tmp/gpus_kv_nccl_trace.txt 2>&1 || rc=1
    last_transfer_trace /tmp/gpus_kv_nccl_trace.txt 256
    cmd .device/tandem bench kv --backend cuda-ipc --device cuda:0,cuda:1 --latency-iters 200 || rc=1
    # the receiver moving every payload (its sender's GPU pushing), for comparison in the same call
    echo "---- cuda-ipc, receiver-driven (TANDEM_KV_NO_SENDER_WRITES=1)"
    TANDEM_KV_NO_SENDER_WRITES=1 cmd .device/tandem kv conformance cuda-ipc --device cuda:0,cuda:1 || rc=1
    TANDEM_KV_NO_SENDER_WRITES=1 cmd .device/tandem bench kv --backend cuda-ipc --device cuda:0,cuda:1 --latency-iters 50 || rc=1
    # the same with the receiver's GPU pulling (reads over the link) instead of cuda:0 pushing
    echo "---- cuda-ipc, pulls (TANDEM_KV_NO_SENDER_WRITES=1 TANDEM_KV_NO_PUSH=1)"
    TANDEM_KV_NO_SENDER_WRITES=1 TANDEM_KV_NO_PUSH=1 cmd .device/tandem bench kv --backend cuda-ipc --device cuda:0,cuda:1 --latency-iters 50 || rc=1
    # one 256 MiB transfer's timeline (the trace holds the warm-up and the measured runs)
    echo "---- cuda-ipc, TANDEM_KV_TRACE=1, 256 MiB"
    TANDEM_KV_TRACE=1 cmd .device/tandem bench kv --backend cuda-ipc --device cuda:0,cuda:1 --sizes 256 --iters 1 --latency-iters 1 \
        > /tmp/gpus_kv_trace.txt 2>&1 || rc=1
    last_transfer_trace /tmp/gpus_kv_trace.txt 256
    # pools exactly the transfer's size (the layout before 2026-11-28: a 256 MiB transfer then
    # covers whole layer arrays, and cuda-ipc merges the layers' copies), for comparison
    echo "---- both backends, --exact-pool, 256 MiB"
    cmd .device/tandem bench kv --backend nccl --device cuda:0,cuda:1 --sizes 256 --latency-iters 1 --exact-pool || rc=1
    cmd .device/tandem bench kv --backend cuda-ipc --device cuda:0,cuda:1 --sizes 256 --latency-iters 1 --exact-pool || rc=1
    # the receivers in a second process, as a decode node's are (real IPC handles and events, NCCL
    # across processes), for comparison
    echo "---- both backends, --two-processes"
    cmd .device/tandem bench kv --backend nccl --device cuda:0,cuda:1 --latency-iters 50 --two-processes || rc=1
    cmd .device/tandem bench kv --backend cuda-ipc --device cuda:0,cuda:1 --latency-iters 50 --two-processes || rc=1
    return "$rc"
}

# The first sample of metric NAME whose labels include LABEL, from http://ADDR/metrics.
metric() {
    "$PYTHON" - "$1" "$2" "$3" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=5).read().decode()
for line in text.splitlines():
    if line.startswith(sys.argv[2] + "{") and sys.argv[3] in line:
        print(float(line.rsplit(" ", 1)[1])); break
PY
}

stage_gpus_cluster() {
    local model="$CUDA_REF_DIR/small"
    [[ -f "$model/config.json" ]] || { echo "no $model: run the reference stage first"; return 1; }
    [[ -x .device/etcd ]] || { echo "no .device/etcd (copy Debian's /usr/bin/etcd there)"; return 1; }
    local rc=0 backend
    for backend in ${GPUS_CLUSTER_BACKENDS:-nccl cuda-ipc}; do
        start_etcd 23792 23802 "etcd-$backend.log"
        echo "---- $backend: prefill node on cuda:0, decode node on cuda:1"
        gpus_cluster_body "$backend" || { rc=1; echo "$backend: the decode node's log ends:"; tail -25 "$OUT/decode.log"; }
        # each backend's node logs kept (the next backend's overwrite these)
        cp "$OUT/decode.log" "$OUT/decode-$backend.log" 2>/dev/null
        cp "$OUT/prefill.log" "$OUT/prefill-after-$backend.log" 2>/dev/null
        for p in client router prefill decode etcd; do stop_bg "$p"; done
        sleep 1
    done
    return "$rc"
}

gpus_cluster_body() {
    local backend=$1 model="$CUDA_REF_DIR/small" etcd=http://127.0.0.1:23792 router prompt long gen gen_long got i
    local kills=${GPUS_CLUSTER_KILLS:-1} gen_fresh=() gen_after=()
    local node=(--etcd "$etcd" --ttl 2 --model "$model" --kv-connector "$backend")
    prompt="the quick brown fox jumps over the lazy dog and then runs far away into the forest"
    long=$(for i in $(seq 1 120); do printf 'sentence %d of a long document about ships. ' "$i"; done)
    gen=$(cmd .device/tandem generate --model "$model" --device cuda:0 --max-tokens 24 "$prompt") || return 1
    gen_long=$(cmd .device/tandem generate --model "$model" --device cuda:1 --max-tokens 16 "$long") || return 1
    # each kill's prompt and the next one's: ones the decode node has not cached, so their whole KV
    # is in flight
    for ((i = 1; i <= kills; i++)); do
        gen_fresh[i]=$(cmd .device/tandem generate --model "$model" --device cuda:1 --max-tokens 16 "$(kill_prompt "$backend" "$i")" 2>/dev/null) || return 1
        gen_after[i]=$(cmd .device/tandem generate --model "$model" --device cuda:1 --max-tokens 16 "$(after_kill_prompt " $i")" 2>/dev/null) || return 1
    done
    # the same split in one process: tandem up --devices
    got=$(cmd .device/tandem up --model "$model" --device cuda --devices cuda:0,cuda:1 --kv-connector "$backend" \
        --max-tokens 24 --listen 127.0.0.1:0 --prompt "$prompt") || return 1
    got="${got#tandem up: serving on *$'\n'}"
    [[ "$gen" == "$got" ]] || { printf 'generate: %q\nup:       %q\n' "$gen" "$got"; echo "$backend: tandem up --devices differs from generate"; return 1; }
    echo "$backend: tandem up --devices cuda:0,cuda:1 == generate"
    router=$(start_bg router router --etcd "$etcd" --listen 127.0.0.1:0) || return 1
    start_bg prefill prefill "${node[@]}" --device cuda:0 >/dev/null || return 1
    start_bg decode decode "${node[@]}" --device cuda:1 --local-prefill-below 0 \
        --metrics-listen 127.0.0.1:9402 >/dev/null || return 1
    sleep 2
    got=$(cmd .device/tandem client --router "$router" --max-tokens 24 "$prompt" 2>/dev/null) || return 1
    printf 'generate (cuda:0): %q\nclient:            %q\n' "$gen" "$got"
    [[ "$gen" == "$got" ]] || { echo "$backend: cluster across GPUs differs from generate"; return 1; }
    grep "first KV transfer" "$OUT/prefill.log" | tail -1
    grep -q "first KV transfer" "$OUT/prefill.log" || { echo "$backend: no transfer logged by the prefill node"; return 1; }
    grep -q "backend.*$backend" "$OUT/prefill.log" || { echo "$backend: the prefill node did not use $backend"; return 1; }
    got=$(cmd .device/tandem client --router "$router" --max-tokens 16 "$long" 2>/dev/null) || return 1
    [[ "$gen_long" == "$got" ]] || { printf 'generate: %q\nclient:   %q\n' "$gen_long" "$got"; echo "$backend: long prompt differs"; return 1; }
    echo "$backend: prefill cuda:0 -> decode cuda:1 == generate (two prompts)"
    if [[ "$backend" == cuda-ipc ]]; then
        # between the processes the sender's GPU (named by UUID in the hello) must push
        grep "cuda-ipc: the sender's GPU" "$OUT/decode.log" | tail -1
        grep -q "the sender's GPU pushes KV into ours" "$OUT/decode.log" || { echo "cuda-ipc: the decode node pulls instead of having cuda:0 push"; return 1; }
        # and, granted each transfer, the prefill node writes the decode node's blocks itself
        grep "cuda-ipc: the sender writes granted" "$OUT/decode.log" | tail -1
        grep -q "cuda-ipc: the sender writes granted" "$OUT/decode.log" || { echo "cuda-ipc: the prefill node does not write the decode node's blocks"; return 1; }
    fi

    # Killed mid-transfer, then a new prefill node into the same decode node: once, or
    # GPUS_CLUSTER_KILLS times (to catch an intermittent fault in the decode node).
    cp "$OUT/prefill.log" "$OUT/prefill-$backend.log"
    local mem0 mem
    # (global: kill_mid_transfer reports it too)
    DECODE_PID=$(cat "$DIR/decode.pid")
    mem0=$(gpu_mem_of "$DECODE_PID")
    for ((i = 1; i <= kills; i++)); do
        echo "---- $backend: kill $i of $kills"
        kill_mid_transfer "$backend" "$i" "${gen_fresh[i]}" "${node[@]}" || return 1
        after_kill "${gen_after[i]}" " $i" "${node[@]}" --device cuda:0 || return 1
        # reported, not judged: what each dead peer leaves in the decode node (communicators,
        # mappings) next to what its engine grew by serving the prompts locally
        mem=$(gpu_mem_of "$DECODE_PID")
        echo "decode node GPU memory after kill $i: $mem MiB ($((mem - mem0)) MiB more than before the first)"
    done
}

# MiB of GPU memory process $1 holds, over every GPU.
gpu_mem_of() {
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | awk -F', ' -v p="$1" '$1 == p {s += $2} END {print s + 0}'
}

# The prompt of kill $2 with backend $1.
kill_prompt() { for i in $(seq 1 100); do printf 'paragraph %d of report %d on rivers and %s. ' "$i" "$2" "$1"; done; }

# A prefill node killed mid-transfer into the decode node of gpus_cluster_body ($router, decode
# metrics on 127.0.0.1:9402). $1: the backend, $2: the kill's number, $3: what `tandem generate`
# answers to its `kill_prompt`; node flags in the rest.
kill_mid_transfer() {
    local backend=$1 gen_fresh=$3 fresh failed used i ppid got
    fresh=$(kill_prompt "$backend" "$2")
    shift 3
    # Killed mid-transfer: the restarted prefill node paces its chunks (300 ms before each; 4 layers,
    # so the transfer takes over 1.2 s) and is killed once its first chunk left — the link (with
    # nccl its communicators, made by the first transfer) up and carrying bytes, the other chunks
    # still to come; the decode node must answer (local prefill) and free every block.
    stop_bg prefill
    sleep 3
    echo "decode node GPU memory once the previous prefill node left: $(gpu_mem_of "$DECODE_PID") MiB"
    failed=$(grep -c "remote prefill failed" "$OUT/decode.log")
    TANDEM_LOG=info,tandem_kv_transfer=debug TANDEM_KV_TEST_CHUNK_DELAY_MS=300 \
        start_bg prefill prefill "$@" --device cuda:0 >/dev/null || return 1
    ppid=$(cat "$DIR/prefill.pid")
    sleep 3
    .device/tandem client --router "$router" --max-tokens 16 "$fresh" >"$DIR/killed.out" 2>"$OUT/client.log" &
    echo $! >"$DIR/client.pid"
    for ((i = 0; i < 200; i++)); do
        grep -q "KV transfer: first chunk sent" "$OUT/prefill.log" && break
        sleep 0.05
    done
    grep -q "KV transfer: first chunk sent" "$OUT/prefill.log" || { echo "$backend: no chunk left the prefill node within 10 s"; return 1; }
    stop_bg prefill
    if [[ "$backend" == nccl ]]; then
        grep -q "nccl communicator made" "$OUT/prefill.log" || { echo "nccl: killed before the link's communicator was made"; return 1; }
        echo "nccl: killed after the link's communicator was made and its first chunk left"
    fi
    if grep -q "prefill done" "$OUT/prefill.log"; then
        echo "$backend: the paced transfer finished before the kill"; return 1
    fi
    echo "prefill node (pid $ppid) killed before its transfer finished (no 'prefill done' logged)"
    wait "$(cat "$DIR/client.pid")" || { echo "$backend: the client failed after the prefill node died"; cat "$OUT/client.log"; return 1; }
    rm -f "$DIR/client.pid"
    got=$(cat "$DIR/killed.out")
    [[ "$gen_fresh" == "$got" ]] || { printf 'generate: %q\nclient:   %q\n' "$gen_fresh" "$got"; echo "$backend: prefill killed: wrong output"; return 1; }
    cat "$OUT/client.log"
    grep "remote prefill failed" "$OUT/decode.log" | tail -1
    (( $(grep -c "remote prefill failed" "$OUT/decode.log") > failed )) || { echo "$backend: the decode node saw no failed transfer (was the kill mid-transfer?)"; return 1; }
    for ((i = 0; i < 50; i++)); do
        used=$(metric 127.0.0.1:9402 tandem:kv_cache_blocks 'state="used"') || used=?
        [[ "$used" == 0.0 ]] && break
        sleep 0.2
    done
    echo "decode node (cuda:1): used KV blocks after the kill: $used"
    echo "decode node GPU memory after the kill: $(gpu_mem_of "$DECODE_PID") MiB"
    [[ "$used" == 0.0 ]] || { echo "$backend: decode blocks still in use"; return 1; }
    if nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -qw "$ppid"; then
        echo "$backend: the killed prefill process still holds GPU memory"; return 1
    fi
    echo "cuda:0 holds nothing of the killed prefill process:"
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | sed 's/^/  /'
    echo "$backend: prefill node killed mid-transfer: output == generate, every block free on both GPUs"
}


stage_gpus_disagg() {
    local extra=()
    read -ra extra <<<"${DISAGG_ARGS:-}"
    local rc=0
    cmd .device/tandem bench disagg --devices cuda:0,cuda:1 --kv-connector cuda-ipc --no-load "${extra[@]}" || rc=1
    cmd .device/tandem bench disagg --devices cuda:0,cuda:1 --kv-connector nccl --no-load "${extra[@]}" || rc=1
    return "$rc"
}

stage_gpus_serve() {
    local workload=()
    read -ra workload <<<"${SERVE_ARGS:---request-rate 2,4,8,16,32 --num-prompts 100 --input-len 1024 --output-len 128 --slo-ttft-ms 300 --slo-itl-ms 30}"
    TANDEM=.device/tandem OUT_DIR="$OUT/gpus_serve" START_TIMEOUT=300 \
        UP_ARGS="--devices cuda:0,cuda:1 --random-weights llama3.1-8b ${SERVE_UP_ARGS:-}" \
        cmd scripts/serve-compare.sh --tokenizer tests/fixtures/tiny/llama "${workload[@]}"
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
if [[ -n "${WANT[kv]:-}" ]]; then run_stage kv || true; fi
if [[ -n "${WANT[cluster2]:-}" ]]; then run_stage cluster2 || true; fi
if [[ -n "${WANT[disagg]:-}" ]]; then run_stage disagg || true; fi
if [[ -n "${WANT[serve]:-}" ]]; then run_stage serve || true; fi
if [[ -n "${WANT[bench]:-}" ]]; then run_stage bench || true; fi
for s in "${GPUS_STAGES[@]}"; do
    if [[ -n "${WANT[$s]:-}" ]]; then run_stage "$s" || true; fi
done

echo
echo "=================== summary ==================="
printf '%-10s %-5s %9s  %s\n' stage result time log
for row in "${ROWS[@]}"; do echo "$row"; done
if ((FAILED)); then
    echo "device-check: FAILED"
    exit 1
fi
echo "device-check: all selected stages passed"
