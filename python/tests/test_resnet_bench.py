"""python/bench/ps_torch_resnet.py (the ResNet-18 benchmark the GPU session runs) at a tiny width
on the CPU, so that it cannot rot: its cluster path (2 shards, 2 worker processes) runs 4 steps,
every rank equals the ghost-batch-norm reference within 1e-5 and is far from plain batch norm
over the global batch (so the check compares against the right computation), and the JSON
holds the figures the report needs, consistent with each other. Refused arguments exit 2."""

import importlib.util
import json
import math

import pytest

from common import REPO

BENCH = REPO / "python" / "bench" / "ps_torch_resnet.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("ps_torch_resnet", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_resnet_bench_cluster_equals_ghost_batch_norm_and_reports_its_figures(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "resnet.json"
    code = bench.main(["--device", "cpu", "--width", "0.0625", "--batch", "4", "--steps", "2",
                       "--warmup", "2", "--check-steps", "2", "--threads", "1",
                       "--timeout", "120", "--json", str(out), "--keep", str(tmp_path / "run")])
    printed = capsys.readouterr().out
    assert code == 0, printed
    res = json.loads(out.read_text())
    params = sum(p.numel() for p in bench.ResNet18(0.0625).parameters())
    assert res["params"] == params == 44_622  # channels 4-8-16-32
    assert (res["batch"], res["global_batch"], res["workers"], res["shards"]) == (4, 8, 2, 2)
    assert res["transport"] == ["shared memory", "shared memory"]

    e = res["equivalence"]
    assert e["pass"] and e["ranks_identical"] and e["check_steps"] == 2
    assert "batch norm over b_r = [4, 4], ghost batch norm, not over 8" in e["statement"]
    for r in e["ranks"]:
        assert r["max_rel_diff"] < 1e-5, r
        assert r["int_buffers_differing"] == [], r
        # plain batch norm over 8 is another computation: a check against it would fail
        assert r["vs_plain_batch_norm"] > 1e-3, r

    single, cluster = res["single"], res["cluster"]
    assert single["timed_steps"] == cluster["timed_steps"] == 2
    for k in ("step_ms", "compute_ms", "push_ms", "pull_ms", "comm_ms"):
        assert cluster[k] > 0, (k, cluster)
    assert math.isclose(cluster["compute_ms"] + cluster["comm_ms"] + cluster["rest_ms"],
                        cluster["step_ms"], rel_tol=1e-9)
    assert math.isclose(single["compute_ms"] + single["optimizer_ms"], single["step_ms"],
                        rel_tol=1e-9)
    assert math.isclose(res["ratio"], cluster["step_ms"] / single["step_ms"], rel_tol=1e-12)
    for f in (single, cluster):  # the window holds the timed steps and the gaps between them
        assert f["wall_ms_per_step"] >= f["step_ms"] * (1 - 1e-9), f
    b = res["bound"]
    assert b["bytes_per_worker_per_step_each_way"] == 4 * params
    assert b["bytes_per_worker_per_step_both_ways"] == 8 * params
    assert math.isclose(sum(b["shares"].values()), 1.0, rel_tol=1e-9)
    assert b["bound_by"] in ("compute", "communication", "rest")
    assert res["bandwidth"]["host_copy_gbps"] > 0
    assert res["shard0"]["steps"] == 2 and res["shard0"]["apply_ms"] >= 0, res["shard0"]
    assert "ratio cluster / one process" in printed and "PASS" in printed


@pytest.mark.parametrize("args, message", [
    (["--check-steps", "6"], "--check-steps must be 1 or more and at most --warmup"),
    (["--batch", "0"], "--batch must be 1 or more"),
])
def test_resnet_bench_refuses_bad_arguments_with_exit_2(args, message, capsys):
    bench = load_bench()
    with pytest.raises(SystemExit) as refused:
        bench.main(["--device", "cpu", *args])
    assert refused.value.code == 2
    assert message in capsys.readouterr().err
