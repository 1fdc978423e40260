#!/usr/bin/env bash
# onehost-grpc.sh: the one-host gRPC data path, end to end. Starts S real `ps-server` shards and
# W `ps-worker` processes on 127.0.0.1 with `[cluster] transport = "grpc"` (tensors through
# gRPC although they share the host), MNIST, batch 64 per worker, plain SGD, and prints the
# median `step_ms` of shard 0 after SKIP steps, with the workers' own pull/compute/push split.
#
#   ps-bench/onehost-grpc.sh                       # 784-1024-1024-10, W = 2, S = 1, 300 steps
#   HIDDEN="4096, 4096" STEPS=30 SKIP=5 S=2 ps-bench/onehost-grpc.sh
#   BIN=/tmp/old-build TRANSPORT=auto ps-bench/onehost-grpc.sh   # another build, or shared memory
#
# Environment: BIN (default target/release), W (2), S (1), HIDDEN ("1024, 1024"), STEPS (300),
# SKIP (20), TRANSPORT ("grpc"), WIRE (unset: the default), PORT (first shard port, 56051).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${BIN:-$ROOT/target/release}"
W="${W:-2}"; S="${S:-1}"; HIDDEN="${HIDDEN:-1024, 1024}"; STEPS="${STEPS:-300}"; SKIP="${SKIP:-20}"
TRANSPORT="${TRANSPORT:-grpc}"; PORT="${PORT:-56051}"
for b in ps-server ps-worker; do
    [ -x "$BIN/$b" ] || { echo "onehost-grpc: $BIN/$b missing: cargo build --release --bins" >&2; exit 2; }
done
RUN="$(mktemp -d /tmp/onehost.XXXXXX)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$RUN"; }
trap cleanup EXIT
servers=""
for s in $(seq 0 $((S - 1))); do servers="$servers${servers:+, }\"127.0.0.1:$((PORT + s))\""; done
wire=""
[ -n "${WIRE:-}" ] && wire="wire = \"$WIRE\""
cat >"$RUN/config.toml" <<CFG
[cluster]
servers = [$servers]
workers = $W
transport = "$TRANSPORT"
$wire

[model]
hidden = [$HIDDEN]

[data]
dir = "$ROOT/data/mnist"

[train]
seed = 1
per_worker_batch = 64
steps = $STEPS
loss_reduction = "mean"
aggregation = "mean"
log_every = 1000000
eval_every = 0

[optimizer]
kind = "sgd"
lr = 0.01

[server]
out_dir = "$RUN/out"
barrier_timeout_secs = 600
CFG
load0="$(cut -d' ' -f1-3 /proc/loadavg)"
for s in $(seq 0 $((S - 1))); do
    "$BIN/ps-server" --config "$RUN/config.toml" --shard "$s" >"$RUN/shard-$s.log" 2>&1 &
    PIDS+=("$!")
done
for r in $(seq 0 $((W - 1))); do
    "$BIN/ps-worker" --config "$RUN/config.toml" --rank "$r" >"$RUN/worker-$r.log" 2>&1 &
    PIDS+=("$!")
done
rc=0
for p in "${PIDS[@]}"; do wait "$p" || rc=1; done
PIDS=()
if [ "$rc" != 0 ]; then
    echo "onehost-grpc: a process failed" >&2
    tail -n 5 "$RUN"/*.log >&2
    exit 1
fi
step="$(tail -n "+$((SKIP + 1))" "$RUN/out/metrics.jsonl" | grep -o '"step_ms":[-0-9.eE+]*' | cut -d: -f2 | sort -g \
    | awk '{v[NR] = $1} END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }')"
split="$(sed -n 's/.*per step \(pull [0-9.]* ms, compute [0-9.]* ms, push [0-9.]* ms\).*/\1/p' "$RUN"/worker-*.log | tr '\n' ';')"
echo "hidden [$HIDDEN] W=$W S=$S transport=$TRANSPORT ${WIRE:+wire=$WIRE }bin=$BIN: step ${step} ms (median after $SKIP of $STEPS); workers: $split load $load0 -> $(cut -d' ' -f1-3 /proc/loadavg)"
