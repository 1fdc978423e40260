#!/usr/bin/env bash
# Offline checks of what cargo's tests cannot see, with tools from PyPI (installed once into the
# virtual environment target/opsenv; pip's cache keeps the wheels):
#   1. the Kubernetes manifests of deploy/k8s against the API schemas of several Kubernetes
#      releases (kubernetes-validate --strict: unknown fields are errors);
#   2. the same manifests against the Pod Security Standards' "restricted" level
#      (scripts/pss_restricted.py), and both tools against a manifest known to be bad, so that a
#      check that stopped checking fails here;
#   3. TensorBoard's own reader on the event file of a short real run (ps-launch, 2 shards,
#      2 workers): every step's loss, accuracy, lr, gradient norm, step time and the test
#      accuracy equal metrics.jsonl's;
#   4. Prometheus' text parser (prometheus-client) on the live shards' /metrics after the run;
#   5. TensorBoard's reader after a crash and `ps-launch --resume` (the whole process group
#      killed past a checkpoint): each step shows once, with the resumed run's value, because
#      the resumed file starts with a SessionLog START (Event field 7) at the resumed step + 1;
#   6. the README's main job (`ps-launch --config deploy/mnist.toml --check-reference`): the
#      numbers of the README's example output, each within the band the README states;
#   7. the README's Fashion-MNIST CNN job (deploy/fashion-cnn.toml), cut to 40 steps.
# Needs the release binaries (the README's test command builds them first) and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV="${PS_OPSENV:-target/opsenv}"
if [ ! -x "$ENV/bin/kubernetes-validate" ] || ! "$ENV/bin/python" -c "import yaml, tensorboard, prometheus_client" 2>/dev/null; then
    echo "deploy-checks: creating $ENV (kubernetes-validate, tensorboard, prometheus-client from the package registry)"
    python3 -m venv "$ENV"
    "$ENV/bin/pip" install --quiet --upgrade pip
    "$ENV/bin/pip" install --quiet kubernetes-validate tensorboard prometheus-client
fi
PY="$ENV/bin/python"
manifests=(deploy/k8s/*.yaml)
work=target/deploy-checks
rm -rf "$work" && mkdir -p "$work"

# 1. schemas of every release from 1.28 (the first whose Jobs label their pods with
# batch.kubernetes.io/controller-uid, the run id) to the newest the tool knows
for v in 1.28.0 1.29.0 1.30.0 1.31.0 1.32.0 1.33.0 1.34.0 1.35.0 1.36.0 1.37.0; do
    echo "deploy-checks: kubernetes-validate --strict --kubernetes-version $v ${manifests[*]}"
    "$ENV/bin/kubernetes-validate" --strict --quiet --kubernetes-version "$v" "${manifests[@]}"
done

# 2. Pod Security "restricted"
echo "deploy-checks: scripts/pss_restricted.py ${manifests[*]}"
"$PY" scripts/pss_restricted.py "${manifests[@]}"

# both tools must reject a bad manifest: an unknown field, and a root, privileged pod
cat > "$work/bad.yaml" <<'EOF'
apiVersion: batch/v1
kind: Job
metadata:
  name: bad
spec:
  completionz: 2
  template:
    spec:
      restartPolicy: Never
      hostNetwork: true
      containers:
        - name: c
          image: ps:latest
          securityContext:
            privileged: true
            runAsUser: 0
            capabilities:
              add: ["SYS_ADMIN"]
      volumes:
        - name: h
          hostPath:
            path: /
EOF
if "$ENV/bin/kubernetes-validate" --strict --quiet --kubernetes-version 1.33.0 "$work/bad.yaml" > "$work/bad-schema.txt" 2>&1; then
    echo "deploy-checks: kubernetes-validate accepted a manifest with an unknown field" >&2
    exit 1
fi
grep -q "completionz" "$work/bad-schema.txt" || { cat "$work/bad-schema.txt"; exit 1; }
if "$PY" scripts/pss_restricted.py "$work/bad.yaml" > "$work/bad-pss.txt"; then
    echo "deploy-checks: pss_restricted.py accepted a privileged root pod" >&2
    exit 1
fi
for rule in hostNetwork privileged "runAsUser 0" "drop ALL" SYS_ADMIN hostPath \
    allowPrivilegeEscalation seccompProfile readOnlyRootFilesystem "not pinned" "memory limit"; do
    grep -q "$rule" "$work/bad-pss.txt" || { echo "deploy-checks: pss_restricted.py missed $rule" >&2; cat "$work/bad-pss.txt"; exit 1; }
done
echo "deploy-checks: both tools reject a bad manifest (kubernetes-validate: the unknown field; $(tail -1 "$work/bad-pss.txt"))"

# 3. TensorBoard reads shard 0's event file, and it says what metrics.jsonl says
cargo build --release --quiet --bin ps-server --bin ps-worker --bin ps-launch
# deploy/mnist.toml cut to 40 steps (it states epochs; steps and epochs exclude each other)
sed -e 's/^epochs = .*/steps = 40/' -e 's|^dir = "../data/mnist"|dir = "../../data/mnist"|' \
    -e 's/^warmup_steps = .*/warmup_steps = 10/' deploy/mnist.toml > "$work/mnist-40.toml"
target/release/ps-launch --config "$work/mnist-40.toml" --out-dir "$work/run" \
    --set train.eval_every=20 --set train.log_every=20 > "$work/run.log" 2>&1 \
    || { tail -30 "$work/run.log"; exit 1; }
"$PY" - "$work/run" <<'EOF'
import glob, json, math, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

out = sys.argv[1]
files = glob.glob(f"{out}/events.out.tfevents.*")
assert len(files) == 1, files
acc = EventAccumulator(out)
acc.Reload()
tags = set(acc.Tags()["scalars"])
want = {"train/loss", "train/accuracy", "train/lr", "train/grad_norm", "time/step_ms",
        "time/barrier_wait_ms", "time/apply_ms", "test/accuracy"}
assert tags == want, tags
lines = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
steps = [l for l in lines if "final" not in l]
final = [l for l in lines if l.get("final")]
assert len(steps) == 40 and len(final) == 1, (len(steps), len(final))
def series(tag):
    return {e.step: e.value for e in acc.Scalars(tag)}
checked = 0
for tag, key in [("train/loss", "loss"), ("train/accuracy", "train_acc"), ("train/lr", "lr"),
                 ("train/grad_norm", "grad_norm"), ("time/step_ms", "step_ms"),
                 ("time/barrier_wait_ms", "barrier_wait_ms"), ("time/apply_ms", "apply_ms")]:
    s = series(tag)
    assert sorted(s) == [l["step"] for l in steps], (tag, sorted(s))
    for l in steps:
        # TensorBoard keeps float32
        assert math.isclose(s[l["step"]], l[key], rel_tol=1e-6, abs_tol=1e-6), (tag, l)
        checked += 1
test = series("test/accuracy")
evals = {l["step"] - 1: l["test_acc_before_step"] for l in steps if "test_acc_before_step" in l}
evals[final[0]["step"]] = final[0]["test_acc"]
assert len(evals) >= 2, evals
assert sorted(test) == sorted(evals), (test, evals)
for k, v in evals.items():
    assert math.isclose(test[k], v, rel_tol=1e-6), (k, test[k], v)
print(f"deploy-checks: TensorBoard's EventAccumulator read {len(files)} event file: "
      f"{len(tags)} scalar tags, {checked} step values and {len(test)} test accuracies equal metrics.jsonl "
      f"(final test accuracy {test[final[0]['step']]:.4f})")
EOF
# 4. Prometheus' own text parser (prometheus-client) on the live shards' /metrics after the
# run's end: with --metrics the shards keep serving until scraped (at most 120 s), so the final
# version and test accuracy reach the scraper
target/release/ps-launch --config "$work/mnist-40.toml" --out-dir "$work/prom" --metrics \
    > "$work/prom.log" 2>&1 &
pid=$!
for _ in $(seq 1200); do
    [ "$(grep -c '/metrics stays up until it is scraped once more' "$work/prom.log")" -ge 2 ] && break
    kill -0 "$pid" 2>/dev/null || { tail -30 "$work/prom.log"; echo "deploy-checks: the run ended before lingering" >&2; exit 1; }
    sleep 0.1
done
addrs=$(sed -n 's|.*shard \([0-9]\): Prometheus metrics on http://\([^/]*\)/metrics.*|\1=\2|p' "$work/prom.log" | sort -u)
"$PY" - "$work/prom" $addrs <<'EOF'
import json, sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families

out, addrs = sys.argv[1], dict(a.split("=") for a in sys.argv[2:])
assert sorted(addrs) == ["0", "1"], addrs
final = [json.loads(l) for l in open(f"{out}/metrics.jsonl") if '"final"' in l][-1]
for shard, addr in sorted(addrs.items()):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=30) as r:
        ctype, body = r.headers["Content-Type"], r.read().decode()
    assert ctype.startswith("text/plain; version=0.0.4"), ctype
    families = {f.name: f for f in text_string_to_metric_families(body)}
    for f in families.values():
        assert f.documentation and not f.documentation.endswith(".."), (f.name, f.documentation)
        assert f.type != "unknown", f.name
    def value(name):
        return next(s.value for s in families[name].samples if s.name == name)
    assert value("ps_version") == 40, value("ps_version")
    assert families["ps_pushes"].type == "counter"
    # every shard publishes the final test accuracy (each rank reports it to every shard)
    assert abs(value("ps_test_accuracy") - final["test_acc"]) < 1e-9, (shard, value("ps_test_accuracy"), final)
    print(f"deploy-checks: prometheus-client parsed shard {shard}'s /metrics after the run: "
          f"{len(families)} families, each with help text, ps_version {value('ps_version'):.0f}")
EOF
wait "$pid" || { tail -30 "$work/prom.log"; echo "deploy-checks: the run with /metrics failed" >&2; exit 1; }

# 5. killed past a checkpoint, resumed: TensorBoard shows each step once
sed -e 's/^epochs = .*/steps = 400/' -e 's|^dir = "../data/mnist"|dir = "../../data/mnist"|' \
    -e 's/^warmup_steps = .*/warmup_steps = 10/' deploy/mnist.toml > "$work/mnist-400.toml"
resume_args=(--config "$work/mnist-400.toml" --out-dir "$work/resumed" --set train.log_every=1
    --set checkpoint.every=10 --set cluster.transport=grpc)
setsid target/release/ps-launch "${resume_args[@]}" > "$work/killed.log" 2>&1 &
pid=$!
for _ in $(seq 1200); do
    [ "$(cat "$work/resumed/metrics.jsonl" 2>/dev/null | wc -l)" -ge 25 ] && break
    kill -0 "$pid" 2>/dev/null || { tail -30 "$work/killed.log"; echo "deploy-checks: the run to kill ended early" >&2; exit 1; }
    sleep 0.1
done
[ "$(wc -l < "$work/resumed/metrics.jsonl")" -ge 25 ] || { echo "deploy-checks: no 25 steps in 120 s" >&2; exit 1; }
kill -KILL -- "-$pid"
wait "$pid" 2>/dev/null || true
# `wait` sees ps-launch alone: its shards and workers, killed at the same moment, may still be
# exiting (a loaded machine takes a while to tear down their memory) and so still hold the
# output directory's locks when the resume starts. Wait (bounded) until nothing of the killed
# session is left but zombies.
session_alive() { ps -e -o sid=,stat= | awk -v s="$1" '$1 == s && $2 !~ /^Z/ { f = 1 } END { exit !f }'; }
for _ in $(seq 300); do session_alive "$pid" || break; sleep 0.1; done
if session_alive "$pid"; then
    ps -e -o pid=,sid=,stat=,args= | awk -v s="$pid" '$2 == s'
    echo "deploy-checks: processes of the killed run still live 30 s after SIGKILL" >&2
    exit 1
fi
before=$(wc -l < "$work/resumed/metrics.jsonl")
target/release/ps-launch "${resume_args[@]}" --resume > "$work/resume.log" 2>&1 \
    || { tail -30 "$work/resume.log"; exit 1; }
"$PY" - "$work/resumed" "$before" <<'EOF'
import collections, glob, json, math, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

out, before = sys.argv[1], int(sys.argv[2])
files = sorted(glob.glob(f"{out}/events.out.tfevents.*"))
assert len(files) == 2, files
acc = EventAccumulator(out)
acc.Reload()
lines = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
steps = [l for l in lines if "final" not in l]
assert [l["step"] for l in steps] == list(range(1, 401)), "metrics.jsonl holds each step once"
loss = acc.Scalars("train/loss")
seen = collections.Counter(e.step for e in loss)
twice = sorted(s for s, n in seen.items() if n > 1)
assert not twice, f"steps TensorBoard shows more than once: {twice}"
assert sorted(seen) == list(range(1, 401)), sorted(set(range(1, 401)) - set(seen))
for e, l in zip(sorted(loss, key=lambda e: e.step), steps):
    assert e.step == l["step"] and math.isclose(e.value, l["loss"], rel_tol=1e-6), (e, l)
print(f"deploy-checks: killed after {before} steps and resumed: TensorBoard's EventAccumulator read "
      f"{len(files)} event files and shows each of the 400 steps once, equal to metrics.jsonl")
EOF

# 6. the README's main job, and the numbers the README shows of it
target/release/ps-launch --config deploy/mnist.toml --check-reference --out-dir "$work/main" \
    > "$work/main.out" 2> "$work/main.err" || { tail -30 "$work/main.err"; cat "$work/main.out"; exit 1; }
"$PY" - README.md "$work/main.out" "$work/main.err" <<'EOF'
import re, sys

readme, out, err = (open(p).read() for p in sys.argv[1:4])

def figures(text):
    """The numbers of the main job's output (the README's example block, or a real run's)."""
    def one(pattern):
        m = re.search(pattern, text)
        assert m, f"no match for {pattern!r} in:\n{text}"
        return m.groups()
    params, version = one(r"\(([\d,]+) parameters\), version (\d+)\)")
    early, = one(r"after 1 step\(s\):  largest relative weight difference ([\d.e+-]+)")
    final, = one(r"after \d+ steps:  largest relative weight difference ([\d.e+-]+)")
    loss = one(r"final loss\s+([\d.]+)\s+([\d.]+)")
    acc = one(r"test accuracy\s+([\d.]+)%\s+([\d.]+)%")
    verdict, = one(r"verdict: (the runs agree|the runs DO NOT agree)")
    return dict(params=params, version=int(version), early=float(early), final=float(final),
                loss=[float(x) for x in loss], acc=[float(x) for x in acc], verdict=verdict)

block = readme[readme.index("ps-launch: cluster finished in"):]
block = block[:block.index("```")]
want, got = figures(block), figures(out)
# exact: the model and the run's length; bands (stated in the README): CPU kernels round
# differently on other machines, so the digits may differ a little
assert got["params"] == want["params"] and got["version"] == want["version"], (got, want)
assert got["verdict"] == want["verdict"] == "the runs agree", (got, want)
assert got["early"] < 1e-6 and want["early"] < 1e-6, (got["early"], want["early"])
assert got["final"] > 1e-2 and want["final"] > 1e-2, (got["final"], want["final"])
for g, w in zip(got["acc"], want["acc"]):
    assert abs(g - w) <= 0.3, ("test accuracy, percent", got["acc"], want["acc"])
for g, w in zip(got["loss"], want["loss"]):
    assert abs(g - w) <= 0.005, ("final loss", got["loss"], want["loss"])
# the log's closing line, as the README shows it
pat = r"training finished: (\d+) steps; final test accuracy ([\d.]+)%"
m, w = re.search(pat, err), re.search(pat, readme)
assert m and w and m.group(1) == w.group(1) and abs(float(m.group(2)) - float(w.group(2))) <= 0.3, (m, w)
print(f"deploy-checks: the README's main job: {got['version']} steps, {got['params']} parameters, "
      f"early-step difference {got['early']:.1e} (README {want['early']:.1e}, both < 1e-6), test accuracy "
      f"{got['acc'][0]:.2f}% / {got['acc'][1]:.2f}% (README {want['acc'][0]:.2f}% / {want['acc'][1]:.2f}%, "
      f"within 0.3 points), final loss {got['loss']} (README {want['loss']}, within 0.005)")
EOF

# 7. the README's Fashion-MNIST CNN job (deploy/fashion-cnn.toml) runs, cut to 40 steps: the
# command whose full run gives the README's accuracy, with the CNN's tensors in the export
echo "deploy-checks: ps-launch --config deploy/fashion-cnn.toml, cut to 40 steps"
target/release/ps-launch --config deploy/fashion-cnn.toml --set train.steps=40 --set train.eval_every=0 \
    --out-dir "$work/fashion-cnn" > "$work/fashion-cnn.log" 2>&1 || { tail -30 "$work/fashion-cnn.log"; exit 1; }
"$PY" - "$work/fashion-cnn" <<'EOF'
import json, sys
out = sys.argv[1]
lines = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
final = [l for l in lines if "final" in l]
assert final and final[-1]["test_acc"] > 0.2, final  # chance is 0.1; 0.33 measured
f = open(f"{out}/model.safetensors", "rb")
n = int.from_bytes(f.read(8), "little")
meta = json.loads(f.read(n))
assert meta["conv1.weight"]["shape"] == [16, 1, 5, 5] and meta["fc2.bias"]["shape"] == [10], meta
print(f"deploy-checks: deploy/fashion-cnn.toml cut to 40 steps: test accuracy {final[-1]['test_acc']:.4f}, "
      f"model.safetensors holds conv1.weight [16, 1, 5, 5] ... fc2.bias [10]")
EOF
echo "deploy-checks: all passed"
