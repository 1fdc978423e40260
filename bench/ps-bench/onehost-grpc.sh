#!/usr/bin/env bash
# onehost-grpc.sh: the one-host gRPC data path, end to end. Starts S real `ps-server` shards and
# W `ps-worker` processes on 127.0.0.1 with `[cluster] transport = "grpc"` (tensors through
# gRPC although they share the host), MNIST, batch 64 per worker, plain SGD, and prints the
# median `step_ms` and `apply_ms` of shard 0 after SKIP steps, with the workers' own pull/compute/push split
# (and, from builds that overlap pulls with forward, what forward waited for each layer),
# and the machine's busy CPU per step over the same steps (the floor: busy CPU / cores).
#
#   bench/ps-bench/onehost-grpc.sh                       # 784-1024-1024-10, W = 2, S = 1, 300 steps
#   HIDDEN="4096, 4096" STEPS=30 SKIP=5 S=2 bench/ps-bench/onehost-grpc.sh
#   BIN=/tmp/old-build TRANSPORT=auto bench/ps-bench/onehost-grpc.sh   # another build, or shared memory
#
# Environment: BIN (default target/release), W (2), S (1), HIDDEN ("1024, 1024"), STEPS (300),
# SKIP (20), TRANSPORT ("grpc"), WIRE (unset: the default), PORT (first shard port, 56051).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
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
# shard-to-shard credential: with S > 1, shard 0 takes the others' step reports as they come
shard_token_file = "$RUN/shard-token"
barrier_timeout_secs = 600
CFG
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$RUN/shard-token"
load0="$(cut -d' ' -f1-3 /proc/loadavg)"
for s in $(seq 0 $((S - 1))); do
    "$BIN/ps-server" --config "$RUN/config.toml" --shard "$s" >"$RUN/shard-$s.log" 2>&1 &
    PIDS+=("$!")
done
for r in $(seq 0 $((W - 1))); do
    "$BIN/ps-worker" --config "$RUN/config.toml" --rank "$r" >"$RUN/worker-$r.log" 2>&1 &
    PIDS+=("$!")
done
# the machine's busy CPU (every process, the kernel's TCP work included) between shard 0's
# step SKIP and its last step, per step: "CPU floor" is that over the cores
busy() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8; exit }' /proc/stat; }
nlines() { [ -f "$RUN/out/metrics.jsonl" ] && wc -l <"$RUN/out/metrics.jsonl" || echo 0; }
n0=""; c0=""; n1=""; c1=""
while [ -z "$n1" ]; do
    n="$(nlines)"
    if [ -z "$n0" ] && [ "$n" -ge "$SKIP" ]; then c0="$(busy)"; n0="$(nlines)"; fi
    if [ -n "$n0" ] && [ "$n" -ge "$STEPS" ]; then c1="$(busy)"; n1="$(nlines)"; fi
    alive=0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.2
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
# apply_ms: the update's time at the barrier's completion (with per-bucket apply, the tail only)
apply="$(tail -n "+$((SKIP + 1))" "$RUN/out/metrics.jsonl" | grep -o '"apply_ms":[-0-9.eE+]*' | cut -d: -f2 | sort -g \
    | awk '{v[NR] = $1} END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }')"
tail_ms="$(tail -n "+$((SKIP + 1))" "$RUN/out/metrics.jsonl" | grep -o '"tail_ms":[-0-9.eE+]*' | cut -d: -f2 | sort -g \
    | awk '{v[NR] = $1} END { if (NR % 2) print v[(NR + 1) / 2]; else if (NR) print (v[NR / 2] + v[NR / 2 + 1]) / 2 }')"
early="$(tail -n "+$((SKIP + 1))" "$RUN/out/metrics.jsonl" | grep -o '"buckets_early":[0-9]*' | cut -d: -f2 | sort -g \
    | awk '{v[NR] = $1} END { if (NR) print v[int((NR + 1) / 2)] }')"
buckets="$(grep -o '"buckets":[0-9]*' "$RUN/out/metrics.jsonl" | tail -n 1 | cut -d: -f2)"
split="$(sed -n 's/.*per step \(pull [0-9.]* ms, compute [0-9.]* ms, push [0-9.]* ms\(; pull wait per layer \[[^]]*\] ms\)\{0,1\}\).*/\1/p' "$RUN"/worker-*.log | tr '\n' ';')"
cpu="CPU not sampled"
if [ -n "$n1" ] && [ "$n1" -gt "$n0" ]; then
    cpu="$(awk -v a="$c0" -v b="$c1" -v n="$((n1 - n0))" -v hz="$(getconf CLK_TCK)" -v cores="$(nproc)" \
        'BEGIN { ms = (b - a) * 1000 / hz / n; printf "CPU %.0f core-ms/step, floor %.1f ms on %d cores", ms, ms / cores, cores }')"
fi
echo "hidden [$HIDDEN] W=$W S=$S transport=$TRANSPORT ${WIRE:+wire=$WIRE }bin=$BIN: step ${step} ms, apply ${apply} ms${tail_ms:+, last arrival to version ${tail_ms} ms}${early:+, $early of $buckets buckets before the barrier} (medians after $SKIP of $STEPS); $cpu; workers: $split load $load0 -> $(cut -d' ' -f1-3 /proc/loadavg)"
