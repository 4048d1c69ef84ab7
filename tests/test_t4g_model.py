"""benchmarks/t4g_model.py: ncu's raw CSV read as ncu writes it (rows of a real H200 profile of the PyTorch runtime's
decode step: a small kernel and cuBLAS reading the 0.8 GB fp16 LM head) and the T4G model's arithmetic."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import t4g_model  # noqa: E402

SAMPLE = Path(__file__).parent / "fixtures" / "ncu_raw_sample.csv"


def test_ncu_raw_csv_rows_become_kernels():
    kernels = t4g_model.parse_ncu(SAMPLE.read_text())
    assert len(kernels) == 2                                     # the units row and ncu's log lines are skipped
    head = kernels[-1]
    assert head["name"].startswith("nvjet_sm90") and head["dram__bytes_read.sum"] == 805_524_992.0
    assert 262144 * 1536 * 2 <= head["dram__bytes_read.sum"] < 1.01 * 262144 * 1536 * 2   # the head, read once
    assert kernels[0]["gpu__time_duration.sum"] == 2080.0 and kernels[0]["smsp__inst_executed.sum"] == 152.0
    assert t4g_model.parse_ncu("==PROF== no kernels\n") == []


def test_each_kernel_takes_its_slowest_bound_and_the_host_gap_is_scaled():
    bw, issue = t4g_model.MODEL["t4g_read_bandwidth_Bps"], t4g_model.MODEL["t4g_warp_issue_per_s"]
    k = dict.fromkeys(t4g_model.METRICS, 0.0)
    weights = {**k, "dram__bytes_read.sum": bw * 4e-3, "lts__t_bytes.sum": bw * 4e-3,
               "gpu__time_duration.sum": 1e6}                          # 4 ms of bytes on a T4G, 1 ms here
    tiny = {**k, "dram__bytes_read.sum": 64.0, "smsp__inst_executed.sum": issue * 1e-6,
            "gpu__time_duration.sum": 2e3}                             # 2 us here beats 1 us of issue
    p = t4g_model.predict([weights, tiny], wall_ms=2.0, rows=1)       # 1.002 ms of kernels here, 0.998 ms host
    assert p["kernels"] == 2 and p["t4g_kernel_ms"] == pytest.approx(4.002, abs=1e-3)
    assert p["t4g_host_ms"] == pytest.approx(0.998 * t4g_model.MODEL["host_factor"], abs=1e-3)
    assert p["t4g_ms_by_bound"]["bytes"] == pytest.approx(4.0) and p["t4g_ms_by_bound"]["duration here"] > 0
    assert p["predicted_tok_s"] == pytest.approx(1e3 / p["t4g_step_ms"], rel=1e-3)
    assert t4g_model.predict([weights, tiny], wall_ms=2.0, rows=8)["predicted_tok_s"] == \
        pytest.approx(8 * p["predicted_tok_s"], rel=1e-3)


def test_t4g_kernels_runs_each_case_beside_its_peers_on_cpu(tmp_path):
    """benchmarks/t4g_kernels.py on CPU (tiny shapes, no ncu): each path of a case timed, and checked to compute what
    the runtime's own path computes (transformers' SDPA attention against serving/torch_attention.py's; the packed
    dot and the fp16 dot against the JAX runtime's multiply-reduce)."""
    import json
    import subprocess

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "t4g_kernels.py"), str(tmp_path), "--tiny",
                        "--no-ncu", "--cases", "attention-1024,w4a16-8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cases = json.loads((tmp_path / "t4g_kernels.json").read_text())["cases"]
    rows = cases["attention-1024"]
    assert list(rows) == ["ours", "transformers_sdpa"]
    assert rows["transformers_sdpa"]["max_abs_diff_vs_first"] < 1e-4
    assert rows["ours"]["ms_here_over_ours"] == 1.0 and rows["transformers_sdpa"]["ms_here"] > 0
    rows = cases["w4a16-8"]
    assert list(rows) == ["reduce", "packed_dot", "fp16_dot"]
    assert all(r["max_abs_diff_vs_first"] < 0.05 for r in rows.values())      # fp16 outputs of size ~10
    assert rows["fp16_dot"]["least_bytes"] > 2 * rows["reduce"]["least_bytes"]  # 2 bytes a weight against 1/2
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "t4g_kernels.py"), str(tmp_path), "--cases",
                          "attention-7"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown case(s) attention-7" in bad.stderr


def test_the_profiled_steps_are_told_apart_by_the_marker():
    """One profiled child runs a step with 1 live sequence, the marker kernel, then a step with 8: each prediction
    gets its own step's kernels (a lone PyTorch stream decodes one row, not 8)."""
    kernel = dict.fromkeys(t4g_model.METRICS, 0.0)
    marker = "void at::cuda::(anonymous namespace)::spin_kernel(long)"
    rows = [{**kernel, "name": n} for n in ("gemv_1", "head_1", marker, "gemm_8", "head_8", "sample_8")]
    steps = t4g_model.split_steps(rows)
    assert {n: [k["name"] for k in ks] for n, ks in steps.items()} == {1: ["gemv_1", "head_1"],
                                                                       8: ["gemm_8", "head_8", "sample_8"]}
    with pytest.raises(ValueError, match="1 profiled steps in ncu's rows, not 2"):
        t4g_model.split_steps(rows[:2])
