#!/usr/bin/env bash
# crosshost.sh: the multi-host benchmark. Makes H "hosts" on this machine, each a network
# namespace with its own /dev/shm (a fresh tmpfs in its own mount namespace, so shared memory
# cannot cross hosts), joined to a switch (a bridge in one more namespace) by one veth pair
# per host shaped with `tc tbf` to RATE in both directions. Each host runs one real
# `ps-server` shard (shard i on host i) and its share of the `ps-worker` processes (rank r on
# host r % H), all with the default `transport = "auto"`: shared memory with the shard on the
# same host, gRPC over the shaped links to the others. For each model and W it prints the step
# time beside its limit, both measured in the same run:
#
#   limit = max(compute step, bytes on the busiest link per step / RATE)
#
# - step: median `step_ms` of shard 0's metrics.jsonl after the first SKIP steps;
# - compute step: the slowest worker's forward+backward per step (its own log line "per step
#   pull …, compute …, push …", less what forward waited for the pulls of its later layers
#   where the build overlaps them: "pull wait per layer […]") plus the shard's median
#   optimizer update (`apply_ms`); on a
#   machine with fewer cores than processes this includes their contention, as the run does;
# - busiest link: the interface byte counters (Ethernet frames, what tbf shapes) of every
#   host's link, each direction, read when shard 0 has logged SKIP steps and again at the last
#   step, divided by the steps in between.
# - CPU: the machine's busy CPU time over the same steps (/proc/stat: user, system, irq and
#   softirq of every process, the kernel's network work included), per step; "CPU floor" is that
#   divided by the cores: no schedule of the same work can take less. "stolen" is time the
#   hypervisor gave to other guests. "of which raw TCP would take": the MB leaving every host
#   per step times the kernel CPU that plain TCP between two of these hosts costs per MB,
#   measured before the runs (python3 sockets, both directions at once; "-" without python3).
# - PyTorch DDP: right after each row, bench/ps-bench/ddp_host.py (gloo, one thread per rank) runs
#   the same MLP, batch and timed steps in the same hosts, ranks placed as the workers and
#   started as they are (one `setsid` session per host holding its processes); its
#   ms/step, the machine's busy CPU per step over its timed steps, and step / DDP ("-" with
#   DDP=0 or without a python that imports torch: $PYTHON, target/pyenv, python3).
#
# Usage (root; iproute2 with `ip netns`, `tc`, `unshare`; binaries built with
# `cargo build --release --bins`):
#
#   bench/ps-bench/crosshost.sh                   # both models, W = 2 and 4, 2 hosts, 4.8 Gbit/s
#   RATE=10gbit HOSTS=4 WORKERS="4" MODELS=small bench/ps-bench/crosshost.sh
#
# Environment: RATE (tc rate, default 4.8gbit), HOSTS (default 2), WORKERS (default "2 4"),
# MODELS ("small large": 784-1024-1024-10 and 784-4096-4096-10), STEPS_SMALL / STEPS_LARGE
# (default 300 / 40), SKIP_SMALL / SKIP_LARGE (default 20 / 5), BIN (default target/release),
# SHARDS_PER_HOST (default 1), DDP=0 (no DDP run), WIRE ("bf16" pushes gradients over the
# network as bfloat16: `[cluster] wire`; unset: the default f32), TRANSPORT ("grpc": no shared
# memory even with the shard on the same host: `[cluster] transport`; unset: "auto"),
# MAX_PENDING (`[server] max_pending_gradients`; unset: the default), KEEP=1 keeps the run
# directory (configs, logs, metrics). Prints a markdown table; exits 2 with one line saying
# why when it cannot run.
#
# PUSHPULL=1: instead of the training runs, the data connection's push and pull of the large
# model against raw TCP moving the same bytes between the same two hosts, alternated in one
# run (`ps-bench --xhost-serve` on host 1, `ps-bench --xhost-client` on host 2: see
# bench/ps-bench/src/xhost.rs; REPEATS timed rounds, default 7; needs `cargo build --release
# -p ps-bench`). RATE=none leaves the links unshaped (the veth pairs' own speed), so that the
# transport's cost is not hidden under the link's. Traffic stays inside the namespaces, which are
# removed at exit.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RATE="${RATE:-4.8gbit}"
HOSTS="${HOSTS:-2}"
SHARDS_PER_HOST="${SHARDS_PER_HOST:-1}"
WORKERS="${WORKERS:-2 4}"
MODELS="${MODELS:-small large}"
WIRE="${WIRE:-}"
BIN="${BIN:-$ROOT/target/release}"
PORT=50051
PREFIX="pxh" # namespaces pxh1..pxhH and pxsw; interfaces eth0 (host side) and p1..pH (switch side)
SWITCH="pxsw"

cannot() { echo "crosshost: cannot run: $*" >&2; exit 2; }

[ "$(id -u)" = 0 ] || cannot "needs root (network namespaces, tc and tmpfs mounts); run it as root or with sudo"
for t in ip tc unshare setsid timeout awk; do
    command -v "$t" >/dev/null || cannot "no '$t' on PATH (iproute2 / util-linux / coreutils)"
done
ip netns list >/dev/null 2>&1 || cannot "'ip netns' does not work here: $(ip netns list 2>&1 | head -n1)"
if [ "${PUSHPULL:-0}" = 1 ]; then
    [ -x "$BIN/ps-bench" ] || cannot "$BIN/ps-bench missing: cargo build --release -p ps-bench (or set BIN)"
else
    for b in ps-server ps-worker; do
        [ -x "$BIN/$b" ] || cannot "$BIN/$b missing: cargo build --release --bins (or set BIN)"
    done
fi
[ -f "$ROOT/data/mnist/train-images-idx3-ubyte" ] || [ -f "$ROOT/data/mnist/train-images-idx3-ubyte.gz" ] \
    || cannot "no MNIST in $ROOT/data/mnist"
[[ "$HOSTS" =~ ^[0-9]+$ ]] && [ "$HOSTS" -ge 2 ] && [ "$HOSTS" -le 16 ] || cannot "HOSTS=$HOSTS: expected 2..16"
for n in $(seq 1 "$HOSTS") sw; do
    ns="$PREFIX$n"; [ "$n" = sw ] && ns="$SWITCH"
    ip netns list | awk '{print $1}' | grep -qx "$ns" && cannot "network namespace $ns already exists (another run? 'ip netns del $ns')"
done

# RATE in bits per second (tc units: bit, kbit, mbit, gbit; k = 1000); "none": not shaped
[ "$RATE" = none ] && [ "${PUSHPULL:-0}" != 1 ] && cannot "RATE=none is for PUSHPULL=1 (the training rows' limit needs the link's rate)"
[ "$RATE" = none ] && RATE_BPS=0 || RATE_BPS="$(awk -v r="$RATE" 'BEGIN {
    if (match(r, /^[0-9.]+/) == 0) exit 1
    v = substr(r, 1, RLENGTH); u = substr(r, RLENGTH + 1)
    m["bit"] = 1; m["kbit"] = 1e3; m["mbit"] = 1e6; m["gbit"] = 1e9; m["tbit"] = 1e12
    if (!(u in m)) exit 1
    printf "%.0f", v * m[u] }')" || cannot "RATE=$RATE: expected a tc rate like 4.8gbit or 500mbit"

RUN="$(mktemp -d /tmp/crosshost.XXXXXX)"
LAUNCHERS=()
cleanup() {
    for pid in "${LAUNCHERS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
    for n in $(seq 1 "$HOSTS"); do ip netns del "$PREFIX$n" 2>/dev/null; done
    ip netns del "$SWITCH" 2>/dev/null
    if [ "${KEEP:-0}" = 1 ]; then echo "crosshost: run directory kept: $RUN" >&2; else rm -rf "$RUN"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- the network: a bridge in $SWITCH, one shaped veth pair per host --------------------------
ip netns add "$SWITCH" || cannot "ip netns add failed"
ip -n "$SWITCH" link add br0 type bridge || cannot "no bridge support in this kernel"
ip -n "$SWITCH" link set lo up
ip -n "$SWITCH" link set br0 up
for i in $(seq 1 "$HOSTS"); do
    ns="$PREFIX$i"
    ip netns add "$ns"
    ip link add name eth0 netns "$ns" type veth peer name "p$i" netns "$SWITCH" || cannot "cannot make veth pairs"
    ip -n "$SWITCH" link set "p$i" master br0
    ip -n "$SWITCH" link set "p$i" up
    ip -n "$ns" addr add "10.78.0.$i/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    # both directions of the host's link: host -> switch on eth0, switch -> host on p$i
    # (this kernel may lack netem: rate only, as in ../shared/bench/crosshost)
    [ "$RATE" = none ] && continue
    ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$RATE" burst 4mb latency 50ms \
        || cannot "tc tbf failed on $ns"
    ip netns exec "$SWITCH" tc qdisc add dev "p$i" root tbf rate "$RATE" burst 4mb latency 50ms \
        || cannot "tc tbf failed on $SWITCH"
done
# (no ping here: a host that cannot reach another shows as workers that cannot connect)

# Bytes of every link direction, one line: "h1_tx h1_rx h2_tx h2_rx ..." (host's eth0 view).
link_bytes() {
    local i out=""
    for i in $(seq 1 "$HOSTS"); do
        out="$out $(ip netns exec "$PREFIX$i" cat /sys/class/net/eth0/statistics/tx_bytes /sys/class/net/eth0/statistics/rx_bytes | tr '\n' ' ')"
    done
    echo "$out"
}

# The machine's CPU time so far, in clock ticks, one line: "busy stolen total" (all cores; busy =
# user + nice + system + irq + softirq, stolen = steal: time the hypervisor gave to others).
cpu_ticks() {
    awk '/^cpu / { busy = $2 + $3 + $4 + $7 + $8; steal = $9; print busy, steal, busy + steal + $5 + $6; exit }' /proc/stat
}

lines() { [ -f "$1" ] && wc -l <"$1" || echo 0; }

median_key() { # median_key FILE KEY SKIP: median of "KEY":<number> over the lines after SKIP
    tail -n "+$(($3 + 1))" "$1" | grep -o "\"$2\":[-0-9.eE+]*" | cut -d: -f2 | sort -g \
        | awk '{v[NR] = $1} END { if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# --- raw TCP over the same links ---------------------------------------------------------------
# Host 1 and host 2 send RAW_MB each to the other at once, one TCP stream per direction (python3:
# plain sendall / recv_into, no framework). Prints "gbit_per_direction kernel_core_ms_per_MB":
# the kernel's CPU time (system + irq + softirq on every core) per MB moved from one host to
# another, what the network path costs the machine whoever sends.
raw_tcp() {
    command -v python3 >/dev/null || { echo "nan nan"; return; }
    local py="$RUN/rawtcp.py" mb="${RAW_MB:-400}"
    cat >"$py" <<'PY'
import socket, sys, time
if sys.argv[1] == "sink":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); buf = bytearray(1 << 20)
    while c.recv_into(buf): pass
else:
    c = socket.create_connection((sys.argv[2], int(sys.argv[3]))); data = b"\0" * (4 << 20)
    t = time.time()
    for _ in range(int(sys.argv[4]) // 4): c.sendall(data)
    c.close(); print(time.time() - t)
PY
    local k0 k1 t1 t2 rd
    (timeout 60 ip netns exec "${PREFIX}2" python3 "$py" sink 47001 >"$RUN/sink2" 2>/dev/null &)
    (timeout 60 ip netns exec "${PREFIX}1" python3 "$py" sink 47002 >"$RUN/sink1" 2>/dev/null &)
    for rd in 1 2 3 4 5 6 7 8 9 10; do grep -q ready "$RUN/sink1" "$RUN/sink2" 2>/dev/null && [ -s "$RUN/sink1" ] && [ -s "$RUN/sink2" ] && break; sleep 0.2; done
    k0="$(awk '/^cpu / { print $4 + $7 + $8; exit }' /proc/stat)"
    timeout 60 ip netns exec "${PREFIX}1" python3 "$py" send 10.78.0.2 47001 "$mb" >"$RUN/t1" 2>/dev/null &
    timeout 60 ip netns exec "${PREFIX}2" python3 "$py" send 10.78.0.1 47002 "$mb" >"$RUN/t2" 2>/dev/null
    wait
    k1="$(awk '/^cpu / { print $4 + $7 + $8; exit }' /proc/stat)"
    t1="$(cat "$RUN/t1")"; t2="$(cat "$RUN/t2")"
    awk -v mb="$mb" -v t1="$t1" -v t2="$t2" -v k="$((k1 - k0))" -v hz="$(getconf CLK_TCK)" 'BEGIN {
        t = (t1 > t2 ? t1 : t2); if (t1 <= 0 || t2 <= 0) { print "nan nan"; exit }
        printf "%.2f %.3f\n", mb * 8e6 / t / 1e9, k * 1000 / hz / (2 * mb) }'
}

# --- PyTorch DDP in the same hosts --------------------------------------------------------------
# A python with torch: $PYTHON, else the Python worker's environment (scripts/python-tests.sh
# makes it), else python3; empty when none imports torch (the DDP column then says "-").
find_torch() {
    [ "${DDP:-1}" = 0 ] && return
    local py
    for py in "${PYTHON:-}" "$ROOT/target/pyenv/bin/python" python3; do
        [ -n "$py" ] && command -v "$py" >/dev/null && "$py" -c 'import torch.distributed' 2>/dev/null \
            && { command -v "$py"; return; }
    done
}

# ddp HIDDEN W STEPS SKIP: PyTorch DDP (gloo) with W ranks placed as the workers are (rank r on
# host r % H), same MLP, batch and timed window; prints "MS_PER_STEP BUSY_CORE_MS_PER_STEP", or
# "nan nan" when it fails.
ddp() {
    [ -n "$TORCH_PY" ] || { echo nan nan; return; }
    local r i ranks out="$RUN/ddp-$2-$1"
    # started as ours are: one session per host (setsid) holding that host's ranks, so the
    # kernel's per-session scheduling treats both systems alike
    for i in $(seq 1 "$HOSTS"); do
        ranks=""
        for r in $(seq $(($2 - 1)) -1 0); do [ $((r % HOSTS + 1)) = "$i" ] && ranks="$ranks $r"; done
        [ -n "$ranks" ] || continue
        setsid timeout 600 ip netns exec "$PREFIX$i" sh -c '
            py="$1"; script="$2"; world="$3"; hidden="$4"; steps="$5"; skip="$6"; out="$7"; shift 7
            for r in "$@"; do
                "$py" "$script" --rank "$r" --world "$world" --master 10.78.0.1 --ifname eth0 \
                    --hidden "$hidden" --steps "$steps" --skip "$skip" >"$out.$r" 2>&1 &
            done
            wait' ddp "$TORCH_PY" "$ROOT/bench/ps-bench/ddp_host.py" "$2" "${1// /}" "$3" "$4" "$out" $ranks &
    done
    wait
    sed -n 's/^ddp ms\/step \([0-9.]*\) busy-core-ms\/step \([0-9.]*\)$/\1 \2/p' "$out.0" | grep . \
        || { echo "crosshost: DDP failed: $(tail -n 1 "$out.0")" >&2; echo nan nan; }
}

# --- PUSHPULL=1: the data connection against raw TCP, hosts 1 and 2 ----------------------------
# Prints ps-bench's table; non-zero when either side failed (with the server's log tail).
pushpull() {
    local server rc=0
    setsid timeout 600 ip netns exec "${PREFIX}1" unshare -m --propagation private \
        sh -c 'mount -t tmpfs tmpfs /dev/shm && exec "$0" --xhost-serve 10.78.0.1:'"$PORT" "$BIN/ps-bench" \
        >"$RUN/xhost-serve.log" 2>&1 &
    server=$!
    LAUNCHERS+=("$server")
    timeout 600 ip netns exec "${PREFIX}2" unshare -m --propagation private \
        sh -c 'mount -t tmpfs tmpfs /dev/shm && exec "$0" --xhost-client 10.78.0.1:'"$PORT"' --xhost-repeats "$1"' \
        "$BIN/ps-bench" "${REPEATS:-7}" || rc=1
    wait "$server" || rc=1
    LAUNCHERS=()
    if [ "$rc" != 0 ]; then
        echo "crosshost: PUSHPULL failed; the server's log:" >&2
        tail -n 20 "$RUN/xhost-serve.log" >&2
    fi
    echo "load after the run: $(cut -d' ' -f1-3 /proc/loadavg)"
    return $rc
}

# --- one run ----------------------------------------------------------------------------------
# run MODEL W: prints one markdown row; returns non-zero on failure (with the logs' tails)
run() {
    local model="$1" w="$2" hidden steps skip
    case "$model" in
        small) hidden="1024, 1024"; steps="${STEPS_SMALL:-300}"; skip="${SKIP_SMALL:-20}" ;;
        large) hidden="4096, 4096"; steps="${STEPS_LARGE:-40}"; skip="${SKIP_LARGE:-5}" ;;
        *) echo "crosshost: unknown model $model (small, large)" >&2; return 1 ;;
    esac
    local dir="$RUN/$model-w$w"
    mkdir -p "$dir/logs" "$dir/out"
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/token"
    # the shards' own credential: without it shard 0 refuses the others' step reports and
    # writes metrics.jsonl only at the end (the link and CPU samples need its lines as they come)
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/shard-token"
    # shard k * HOSTS + i - 1 runs on host i at port PORT + k (round robin over the hosts)
    local servers="" i k
    for k in $(seq 0 $((SHARDS_PER_HOST - 1))); do
        for i in $(seq 1 "$HOSTS"); do servers="$servers${servers:+, }\"10.78.0.$i:$((PORT + k))\""; done
    done
    cat >"$dir/config.toml" <<EOF
[cluster]
servers = [$servers]
workers = $w
token_file = "$dir/token"
${WIRE:+wire = \"$WIRE\"}
${TRANSPORT:+transport = \"$TRANSPORT\"}

[model]
hidden = [$hidden]

[data]
dir = "$ROOT/data/mnist"

[train]
seed = 1
per_worker_batch = 64
steps = $steps
loss_reduction = "mean"
aggregation = "mean"
log_every = 1000000
eval_every = 0

[optimizer]
kind = "sgd"
lr = 0.01

[server]
out_dir = "$dir/out"
shard_token_file = "$dir/shard-token"
barrier_timeout_secs = 600
${MAX_PENDING:+max_pending_gradients = $MAX_PENDING}
EOF
    # one launcher per host: its own mount namespace with a fresh /dev/shm, its shard and its
    # workers; fails when any of them does
    LAUNCHERS=()
    for i in $(seq 1 "$HOSTS"); do
        local ranks="" r
        for r in $(seq 0 $((w - 1))); do [ $((r % HOSTS + 1)) = "$i" ] && ranks="$ranks $r"; done
        cat >"$dir/host-$i.sh" <<EOF
mount -t tmpfs tmpfs /dev/shm || exit 3
pids=""
$(for k in $(seq 0 $((SHARDS_PER_HOST - 1))); do
    s=$((k * HOSTS + i - 1))
    echo "\"$BIN/ps-server\" --config \"$dir/config.toml\" --shard $s --listen 0.0.0.0:$((PORT + k)) >\"$dir/logs/shard-$s.log\" 2>&1 &"
    echo "pids=\"\$pids \$!\""
done)
for r in$ranks; do
    "$BIN/ps-worker" --config "$dir/config.toml" --rank \$r >"$dir/logs/worker-\$r.log" 2>&1 &
    pids="\$pids \$!"
done
rc=0
for p in \$pids; do wait \$p || rc=1; done
exit \$rc
EOF
        setsid timeout 900 ip netns exec "$PREFIX$i" unshare -m --propagation private sh "$dir/host-$i.sh" &
        LAUNCHERS+=("$!")
    done
    # sample the link counters when shard 0 has logged `skip` steps and at the last step
    local metrics="$dir/out/metrics.jsonl" n0="" b0="" n1="" b1="" c0="" c1="" n na nb failed=0 deadline=$((SECONDS + 900))
    while :; do
        n="$(lines "$metrics")"
        if [ -z "$n0" ] && [ "$n" -ge "$skip" ]; then
            na="$n"; b0="$(link_bytes)"; c0="$(cpu_ticks)"; nb="$(lines "$metrics")"; n0="$(awk -v a="$na" -v b="$nb" 'BEGIN {print (a + b) / 2}')"
        fi
        if [ -n "$n0" ] && [ "$n" -ge "$steps" ]; then
            na="$n"; b1="$(link_bytes)"; c1="$(cpu_ticks)"; nb="$(lines "$metrics")"; n1="$(awk -v a="$na" -v b="$nb" 'BEGIN {print (a + b) / 2}')"
            break
        fi
        # a host that ended before the last step failed (or the run cannot finish without it)
        local pid
        for pid in "${LAUNCHERS[@]}"; do
            if ! kill -0 "$pid" 2>/dev/null && [ "$(lines "$metrics")" -lt "$steps" ]; then
                failed=1
                echo "crosshost: $model W=$w: a host's processes ended before step $steps" >&2
            fi
        done
        [ "$failed" = 1 ] && break
        [ "$SECONDS" -gt "$deadline" ] && { failed=1; echo "crosshost: $model W=$w still running after 900 s" >&2; break; }
        sleep 0.2 # (a slower poll: the loop's own forks would take CPU from the run)
    done
    local rc=0 pid
    for pid in "${LAUNCHERS[@]}"; do
        if [ "$failed" = 1 ]; then kill -TERM -- "-$pid" 2>/dev/null; fi
        wait "$pid" || rc=1
    done
    LAUNCHERS=()
    if [ -n "$n1" ] && awk -v a="$n0" -v b="$n1" 'BEGIN { exit !(b <= a) }'; then
        echo "crosshost: $model W=$w: shard 0's metrics.jsonl did not grow between the two samples ($n0 and $n1 lines): no per-step figures" >&2
        failed=1
    fi
    if [ "$failed" = 1 ] || [ "$rc" != 0 ] || [ -z "$n1" ]; then
        echo "crosshost: $model W=$w failed; last log lines:" >&2
        for f in "$dir"/logs/*.log; do echo "--- $f" >&2; tail -n 5 "$f" >&2; done
        return 1
    fi
    local step_ms apply_ms compute_ms
    step_ms="$(median_key "$metrics" step_ms "$skip")"
    apply_ms="$(median_key "$metrics" apply_ms "$skip")"
    # the slowest worker's "per step ... compute X ms", less what its forward pass waited for
    # the pulls of layers after the first (builds that overlap pulls with forward count those
    # waits in "compute": "...; pull wait per layer [w0, w1, ...] ms")
    compute_ms="$(cat "$dir"/logs/worker-*.log | sed -n 's/.*per step pull [0-9.]* ms, compute \([0-9.]*\) ms[^;]*\(; pull wait per layer \[\([^]]*\)\]\)\{0,1\}.*/\1 \3/p' \
        | awk '{ c = $1; gsub(",", " "); for (k = 3; k <= NF; k++) c -= $k; print c }' | sort -g | tail -n 1)"
    [ -n "$compute_ms" ] || { echo "crosshost: $model W=$w: no worker timing line in the logs" >&2; return 1; }
    local ddp_ms ddp_cpu; read -r ddp_ms ddp_cpu < <(ddp "$hidden" "$w" "$steps" "$skip")
    awk -v model="$model" -v w="$w" -v hosts="$HOSTS" -v rate="$RATE" -v bps="$RATE_BPS" \
        -v step="$step_ms" -v apply="$apply_ms" -v compute="$compute_ms" \
        -v n0="$n0" -v n1="$n1" -v b0="$b0" -v b1="$b1" -v c0="$c0" -v c1="$c1" \
        -v hz="$(getconf CLK_TCK)" -v cores="$(nproc)" -v kms="$RAW_KMS_PER_MB" -v ddp="$ddp_ms" -v ddp_cpu="$ddp_cpu" 'BEGIN {
        split(b0, x, " "); split(b1, y, " ")
        steps = n1 - n0; best = 0; which = ""
        for (k = 1; k in y; k++) {
            per = (y[k] - x[k]) / steps
            if (per > best) { best = per; which = "host " int((k + 1) / 2) (k % 2 ? " out" : " in") }
        }
        link_ms = best * 8 / bps * 1e3
        sent = 0 # MB leaving all hosts per step (each host tx)
        for (k = 1; k in y; k += 2) sent += (y[k] - x[k]) / steps / 1e6
        tcp_ms = (kms == "nan") ? -1 : sent * kms
        cstep = compute + apply
        limit = cstep > link_ms ? cstep : link_ms
        # CPU: every process on the machine (the run, and the kernel network work)
        split(c0, p, " "); split(c1, q, " ")
        busy_ms = (q[1] - p[1]) * 1000 / hz / steps
        util = (q[3] > p[3]) ? (q[1] - p[1]) / (q[3] - p[3]) : 0
        steal = (q[3] > p[3]) ? (q[2] - p[2]) / (q[3] - p[3]) : 0
        printf "| %s | %d | %d | %s | %.1f | %.1f + %.1f = %.1f | %.2f (%s) | %.1f | %.1f | %.2f | %.0f (%.0f%% busy, %.0f%% stolen) | %s | %.1f | %s | %s |\n",
            model == "small" ? "784-1024-1024-10" : "784-4096-4096-10", w, hosts, rate, step,
            compute, apply, cstep, best / 1e6, which, link_ms, limit, step / limit,
            busy_ms, 100 * util, 100 * steal, tcp_ms < 0 ? "-" : sprintf("%.0f", tcp_ms), busy_ms / cores,
            ddp == "nan" ? "-" : sprintf("%.1f (%.0f core-ms)", ddp, ddp_cpu), ddp == "nan" ? "-" : sprintf("%.2f", step / ddp)
    }'
}

echo "crosshost: $HOSTS hosts (network + /dev/shm namespaces) on a switch, each link $RATE each way; $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
if [ "${PUSHPULL:-0}" = 1 ]; then
    pushpull
    exit $?
fi
read -r RAW_GBIT RAW_KMS_PER_MB < <(raw_tcp)
if [ "$RAW_GBIT" = nan ]; then
    echo "raw TCP between hosts not measured (no python3, or its transfer failed): no raw TCP column" >&2
else
    echo "raw TCP between hosts 1 and 2, one stream each way at once: $RAW_GBIT Gbit/s each way; the kernel spends $RAW_KMS_PER_MB core-ms per MB moved" >&2
fi
echo
[ -n "$WIRE" ] && echo "[cluster] wire = \"$WIRE\" (gradients pushed over the network as $WIRE)"
TORCH_PY="$(find_torch)"
if [ -n "$TORCH_PY" ]; then
    echo "PyTorch DDP (gloo, one thread per rank, ranks placed as the workers) runs after each row in the same hosts: $TORCH_PY" >&2
else
    echo "no DDP column (DDP=0, or no python with torch: PYTHON, target/pyenv from scripts/python-tests.sh, python3)" >&2
fi
echo "| model | W | hosts | link | step ms (median) | compute step ms (fwd+bwd + apply) | busiest link MB/step | link ms | limit ms | step / limit | CPU core-ms/step | of which raw TCP would take | CPU floor ms | PyTorch DDP ms/step (CPU core-ms/step) | step / DDP |"
echo "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
status=0
for model in $MODELS; do
    for w in $WORKERS; do
        run "$model" "$w" || status=1
    done
done
echo
echo "load after the runs: $(cut -d' ' -f1-3 /proc/loadavg)"
exit $status
