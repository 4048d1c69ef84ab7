"""benchmarks/t4g_model.py: ncu's raw CSV and the tracers' records read as they are written, the kernels of two
processes joined, and the T4G model's arithmetic, scaling rules included. The committed table is what the model
makes of the committed raw records."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks import t4g_model as tm

ROOT = Path(__file__).resolve().parents[1]

SAMPLE = Path(__file__).parent / "fixtures" / "ncu_raw_sample.csv"
RESULTS = ROOT / "benchmarks" / "results" / "t4g_model"
C = tm.POINT
HERE = {"clock_hz": 1.98e9, "sms": 132}


def kernel(dur_us: float, blocks: int = 1, read: float = 0.0, write: float = 0.0, inst: float = 0.0,
           fma: float = 0.0, name: str = "k") -> dict:
    return {"name": name, "dur_ns": dur_us * 1e3, "blocks": blocks, "dram__bytes_read.sum": read,
            "dram__bytes_write.sum": write, "smsp__inst_executed.sum": inst, "smsp__inst_executed_pipe_fma.sum": fma,
            "profiled": True}


def test_ncu_raw_csv_rows_become_kernels():
    kernels = tm.parse_ncu(SAMPLE.read_text())
    assert len(kernels) == 2                                     # the units row and ncu's log lines are skipped
    head = kernels[-1]
    assert head["name"].startswith("nvjet_sm90") and head["dram__bytes_read.sum"] == 805_524_992.0
    assert 262144 * 1536 * 2 <= head["dram__bytes_read.sum"] < 1.01 * 262144 * 1536 * 2   # the head, read once
    assert kernels[0]["gpu__time_duration.sum"] == 2080.0 and kernels[0]["smsp__inst_executed.sum"] == 152.0
    assert tm.parse_ncu("==PROF== no kernels\n") == []


def test_the_tracers_spelling_and_ncus_name_the_same_kernel():
    ncu_name = tm.parse_ncu(SAMPLE.read_text())[0]["name"]        # 'void <unnamed>::elementwise_kernel_with_index<'
    kineto = ("void at::native::(anonymous namespace)::elementwise_kernel_with_index<int, at::native::arange_cuda_out"
              "(c10::Scalar const&)::{lambda()#1}>(int, long, long*)")
    assert tm.base_name(ncu_name) == tm.base_name(kineto) == "elementwise_kernel_with_index"
    assert tm.base_name("input_reduce_fusion_306") == "input_reduce_fusion_306"
    assert tm.base_name("void at::cuda::(anonymous namespace)::spin_kernel(long)") == tm.MARKER


def test_ncu_profiles_the_chosen_names_as_whole_identifiers_and_the_marker():
    pattern = re.compile(tm.ncu_filter(["fusion_3", "gemv2T_kernel_val"]).removeprefix("regex:"))
    for name in ("fusion_3", "void gemv2T_kernel_val<int, int, __half>(...)", "at::cuda::spin_kernel"):
        assert pattern.search(name), name
    for name in ("fusion_30", "input_fusion_3x", "gemv2T_kernel_val2"):
        assert not pattern.search(name), name


def test_the_budget_takes_the_longest_kernels_whose_launches_fit():
    steps = [[kernel(50, name="head"), kernel(9, name="fusion"), kernel(9, name="fusion"), kernel(1, name="add")] * 1,
             [kernel(55, name="head"), kernel(8, name="fusion"), kernel(2, name="norm"), kernel(2, name="norm")]]
    assert tm.heavy_names(steps, budget=5) == ["head", "fusion"]         # 2 + 3 launches
    assert tm.heavy_names(steps, budget=4) == ["head", "norm"]           # fusion's 3 no longer fit; norm's 2 do
    assert tm.heavy_names(steps, budget=1) == ["add"]


def test_each_traced_kernel_takes_its_own_ncu_row_in_launch_order():
    traced = [{"name": "void gemv<1>(int)", "dur_ns": 5e3, "blocks": 4}, {"name": "add", "dur_ns": 1e3, "blocks": 1},
              {"name": "void gemv<2>(int)", "dur_ns": 6e3, "blocks": 4}, {"name": "gemv", "dur_ns": 6e3, "blocks": 4}]
    rows = [{"name": "gemv<1>", **dict.fromkeys(tm.METRICS, 0.0), "dram__bytes_read.sum": 10.0},
            {"name": "void gemv<2>(int)", **dict.fromkeys(tm.METRICS, 0.0), "dram__bytes_read.sum": 20.0}]
    joined = tm.join(traced, rows)
    assert [k.get("dram__bytes_read.sum") for k in joined] == [10.0, None, 20.0, None]
    assert [bool(k.get("profiled")) for k in joined] == [True, False, True, False]
    assert joined[0]["dur_ns"] == 5e3                   # the duration stays the tracer's (ncu's is slowed)


def test_each_kernel_takes_its_slowest_bound_with_turings_constants():
    bw, clock = C["t4g_bandwidth_Bps"], C["t4g_clock_hz"]
    # bytes: reads and writes both cross DRAM
    t, bound = tm.t4g_kernel_s(kernel(1, read=bw * 3e-3, write=bw * 1e-3), C, HERE)
    assert bound == "bytes" and t == pytest.approx(4e-3)
    # issue: an FP32-pipe warp instruction takes 2 cycles of a Turing scheduler (one on Hopper)
    cycles = 160 * clock * 1e-3                          # 1 ms of issue on 40 SMs x 4 schedulers
    assert tm.t4g_kernel_s(kernel(1, inst=cycles), C, HERE) == (pytest.approx(1e-3), "issue")
    assert tm.t4g_kernel_s(kernel(1, inst=cycles, fma=cycles), C, HERE)[0] == pytest.approx(2e-3)
    # latency: the duration here scaled by clock, and by SM waves once the grid is wider than 40 SMs
    ratio = HERE["clock_hz"] / clock
    assert tm.t4g_kernel_s(kernel(100, blocks=36), C, HERE) == (pytest.approx(100e-6 * ratio), "latency")
    assert tm.t4g_kernel_s(kernel(100, blocks=80), C, HERE)[0] == pytest.approx(100e-6 * ratio * 2)
    assert tm.t4g_kernel_s(kernel(100, blocks=4096), C, HERE)[0] == pytest.approx(100e-6 * ratio * 132 / 40)
    # every kernel costs at least the launch floor
    assert tm.t4g_kernel_s(kernel(0.2), C, HERE) == (C["t4g_launch_floor_s"], "launch floor")


def test_a_step_is_the_slower_lane_and_the_pessimistic_bound_adds_them():
    bw = C["t4g_gemv_Bps"]
    weights = kernel(1000, read=bw * 10e-3)                # a GEMV: 10 ms of bytes on a T4G, 1 ms here
    gpu_bound = tm.predict([weights], wall_ms=1.5, rows=1, c=C, here=HERE)
    assert gpu_bound["bound_by"] == "gpu" and gpu_bound["t4g_step_ms"] == pytest.approx(10.0)
    assert gpu_bound["t4g_host_ms"] == pytest.approx(1.5 * C["host_factor"])
    assert gpu_bound["predicted_tok_s"] == pytest.approx(100.0)
    assert tm.predict([weights], 1.5, rows=8, c=C, here=HERE)["predicted_tok_s"] == pytest.approx(800.0)
    host_bound = tm.predict([weights], wall_ms=8.0, rows=1, c=C, here=HERE)    # eager: the host launches all step
    assert host_bound["bound_by"] == "host" and host_bound["t4g_step_ms"] == pytest.approx(8.0 * C["host_factor"])
    serial = tm.predict([weights], wall_ms=8.0, rows=1, c=C, here=HERE, overlap=False, host_all_wall=False)
    assert serial["t4g_step_ms"] == pytest.approx(10.0 + 7.0 * C["host_factor"])  # only the uncovered 7 ms here
    assert serial["host_ms_here"] == pytest.approx(7.0)
    # kernels ncu could not profile never make the GPU lane shorter than reading the plan's weights
    hidden = tm.predict([kernel(1000)], wall_ms=1.5, rows=1, c=C, here=HERE, least_bytes=bw * 12e-3)
    assert hidden["t4g_kernel_ms"] == pytest.approx(12.0) and hidden["weights_floor_ms"] == pytest.approx(12.0)


def test_a_cells_range_brackets_its_point_and_calibration_reports_its_error():
    bw = C["t4g_gemv_Bps"]
    steps = {"1": [kernel(1000, read=bw * 20e-3), kernel(1, name="small", write=4096)] * 2,
             "8": [kernel(1000, read=bw * 20e-3, name="big8")] * 2}
    cell = tm.cell_prediction({"steps": steps, "step_ms_1": 40.0, "step_ms_8": 10.0, "here": HERE})
    for live in (1, 8):
        low, high = cell[f"step{live}"]["range_tok_s"]
        assert low < cell[f"predicted_tok_s_{live}"] < high
    assert cell["bytes_per_token"] == int(2 * bw * 20e-3) + 2 * 4096          # what is written crosses DRAM too
    cal = tm.calibration(cell)
    assert cal["predicted_step_ms_1"] == pytest.approx(40.0 * C["host_factor"])      # host-bound
    assert cal["error_pct"] == pytest.approx((100.0 / 93.2 - 1) * 100, abs=0.1) and cal["within_20pct"]
    assert cal["implied_host_factor"] == pytest.approx(93.2 / 40.0, abs=0.01)


def test_the_profiled_steps_are_told_apart_by_the_marker():
    kernel_ = dict.fromkeys(tm.METRICS, 0.0)
    marker = "void <unnamed>::spin_kernel(long)"
    rows = [{**kernel_, "name": n} for n in ("gemv_1", "head_1", marker, "gemm_8", "head_8", "sample_8")]
    assert [[k["name"] for k in s] for s in tm.split_steps(rows)] == [["gemv_1", "head_1"],
                                                                       ["gemm_8", "head_8", "sample_8"]]
    with pytest.raises(ValueError, match="1 profiled steps in ncu's rows, not 2"):
        tm.split_steps(rows[:2])


def test_tracer_records_become_kernels_in_start_order():
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "b", "ts": 20.0, "dur": 3.5, "args": {"grid": [4, 2, 1], "block": [128, 1, 1]}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 5.0, "dur": 9.0},
        {"cat": "kernel", "name": "a", "ts": 10.0, "dur": 1.0, "args": {"grid": [1, 1, 1]}}]}
    assert tm.torch_trace_kernels(trace) == [{"name": "a", "dur_ns": 1000.0, "blocks": 1},
                                             {"name": "b", "dur_ns": 3500.0, "blocks": 8}]
    ev = types.SimpleNamespace
    stream = ev(name="Stream #13(Compute)", events=[
        ev(name="fusion_2", start_ns=30, duration_ns=2000, stats=[("kernel_details", "regs:32 grid:36,1,1 block:256,1,1")]),
        ev(name="MemcpyD2D", start_ns=5, duration_ns=900, stats=[]),
        ev(name="gemv", start_ns=10, duration_ns=5000, stats=[])])
    ops = ev(name="XLA Ops", events=[ev(name="dot.3", start_ns=10, duration_ns=5000, stats=[])])
    profile = ev(planes=[ev(name="/host:CPU", lines=[stream]), ev(name="/device:GPU:0", lines=[ops, stream])])
    assert tm.jax_trace_kernels(profile) == [{"name": "gemv", "dur_ns": 5000.0, "blocks": 1},
                                             {"name": "fusion_2", "dur_ns": 2000.0, "blocks": 36}]


def test_the_committed_table_is_what_the_model_makes_of_the_committed_records(tmp_path):
    (tmp_path / "raw").mkdir()
    for p in (RESULTS / "raw").glob("*.json"):
        (tmp_path / "raw" / p.name).write_bytes(p.read_bytes())
    r = subprocess.run([sys.executable, "-m", "benchmarks.t4g_model", str(tmp_path), "--recompute"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    made, committed = (json.loads(p.read_text()) for p in (tmp_path / "t4g_model.json", RESULTS / "t4g_model.json"))
    assert made["runtimes"] == committed["runtimes"] and made["calibration"] == committed["calibration"]
    assert made["constants"] == committed["constants"] and all(c["source"] for c in made["constants"].values())
    for runtime in ("pytorch", "jax"):
        assert set(made["runtimes"][runtime]) >= set(tm.SCHEMES)
    cal = made["calibration"]["transformers_eager"]
    assert cal["published_step_ms_1"] == 93.2 and {"predicted_step_ms_1", "predicted_step_ms_8"} <= set(cal)


@pytest.mark.slow
def test_the_measure_runs_its_children_on_cpu(tmp_path):
    """The whole measure on a CPU (tiny widths, no ncu): checkpoints made, transformers' eager decode and our
    PyTorch engine loaded and stepped with 1 and 8 live sequences in the measure child."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.t4g_model", str(tmp_path / "out"), "--tiny",
                        "--no-ncu", "--steps", "2", "--runtimes", "transformers,pytorch", "--schemes", "fp16",
                        "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("transformers-fp16", "pytorch-fp16"):
        raw = json.loads((tmp_path / "out" / "raw" / f"{name}.json").read_text())
        assert "error" not in raw and raw["step_ms_1"] > 0 and raw["step_ms_8"] > 0, raw


def test_t4g_kernels_runs_each_case_beside_its_peers_on_cpu(tmp_path):
    """benchmarks/t4g_kernels.py on CPU (tiny shapes, no ncu): each path of a case timed, and checked to compute what
    the runtime's own path computes (SDPA's attention against serving/torch_runtime/attention.py's GEMMs; the packed
    dot and the fp16 dot against the JAX runtime's multiply-reduce)."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.t4g_kernels", str(tmp_path), "--tiny",
                        "--no-ncu", "--cases", "attention-1024-8,w4a16-8"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cases = json.loads((tmp_path / "t4g_kernels.json").read_text())["cases"]
    rows = cases["attention-1024-8"]
    assert list(rows) == ["ours", "memory_efficient", "transformers_sdpa"]
    assert all(rows[p]["max_abs_diff_vs_first"] < 1e-4 for p in ("memory_efficient", "transformers_sdpa"))
    assert rows["ours"]["ms_here_over_ours"] == 1.0 and rows["transformers_sdpa"]["ms_here"] > 0
    rows = cases["w4a16-8"]
    assert list(rows) == ["reduce", "packed_dot", "fp16_dot"]
    assert all(r["max_abs_diff_vs_first"] < 0.05 for r in rows.values())      # fp16 outputs of size ~10
    assert rows["fp16_dot"]["least_bytes"] > 2 * rows["reduce"]["least_bytes"]  # 2 bytes a weight against 1/2
    bad = subprocess.run([sys.executable, "-m", "benchmarks.t4g_kernels", str(tmp_path), "--cases",
                          "attention-7"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown case(s) attention-7" in bad.stderr


# ------------------------------------------------------------------------------ round 3: the GPU lane calibrated
def test_the_gemv_rate_is_the_published_kernel_times_over_the_bytes_they_read():
    src = tm.GEMV_SOURCE
    assert src["published_total_ms"] == pytest.approx(10.155 + 9.634) == pytest.approx(19.79, abs=0.005)
    # the bytes: the memory plan's streamed bytes of the E2B fp16 checkpoint, as the measure recorded them, less the
    # tied LM head (262 144 x 1536 fp16)
    eager = json.loads((RESULTS / "raw" / "transformers-fp16.json").read_text())
    assert src["plan_streamed_bytes"] == eager["plan_streamed_bytes"]
    assert src["bytes"] == eager["plan_streamed_bytes"] - 262_144 * 1536 * 2
    rate = tm.CONSTANTS["t4g_gemv_Bps"]
    assert rate["value"] == pytest.approx(src["bytes"] / 19.789e-3, rel=1e-5)
    assert 0.6 < rate["value"] / C["t4g_bandwidth_Bps"] < 0.72          # the source's "about two thirds" of copy
    assert rate["pessimistic"] < rate["value"] < rate["optimistic"] < C["t4g_bandwidth_Bps"]
    assert rate["optimistic"] == pytest.approx(src["plan_streamed_bytes"] / 19.789e-3, rel=1e-5)
    assert "gemv2T" in rate["source"] and "19.79" in rate["source"]


def test_a_gemv_is_a_profiled_large_read_into_a_small_output_not_attention():
    mib = 2**20
    assert tm.gemv_kind(kernel(10, read=12 * mib, write=mib / 64, name="nvjet_sm90_hsh_128x8_64x12_4x1_v_bz_TNT"))
    assert tm.gemv_kind(kernel(10, read=5 * mib, name="input_reduce_fusion_288"))     # XLA's packed multiply-reduce
    assert tm.gemv_kind(kernel(10, read=805e6, write=1e6, name="void gemv2T_kernel_val<int, int, __half>(...)"))
    assert not tm.gemv_kind(kernel(10, read=12 * mib, write=12 * mib, name="vectorized_elementwise_kernel"))
    assert not tm.gemv_kind(kernel(10, read=12 * mib, name="fmha_cutlassF_f16_aligned_32x128_gmem_sm80"))
    assert not tm.gemv_kind(kernel(10, read=mib - 1, name="gemvx_kernel"))           # under 1 MiB: not counted
    unprofiled = {**kernel(10, read=12 * mib, name="gemvx_kernel"), "profiled": False}
    assert not tm.gemv_kind(unprofiled) and not tm.gemv_kind({"name": "gemvx", "dur_ns": 1e4})


def test_a_gemv_streams_at_the_gemv_rate_and_a_copy_at_the_copy_rate():
    read = 100e6
    t, bound = tm.t4g_kernel_s(kernel(1, read=read, name="gemv"), C, HERE)
    assert bound == "gemv bytes" and t == pytest.approx(read / C["t4g_gemv_Bps"])
    t, bound = tm.t4g_kernel_s(kernel(1, read=read / 2, write=read / 2, name="copy"), C, HERE)
    assert bound == "bytes" and t == pytest.approx(read / C["t4g_bandwidth_Bps"])
    # the weights floor of a step is the plan's weights read through GEMVs
    p = tm.predict([kernel(1)], wall_ms=0.1, rows=1, c=C, here=HERE, least_bytes=read)
    assert p["weights_floor_ms"] == pytest.approx(read / C["t4g_gemv_Bps"] * 1e3, abs=1e-3)
    # the JSON says which kernels the rate applied to, per step
    ks = [kernel(1, read=read, name="void gemv2T_kernel_val<int>(int)"), kernel(1, read=read, name="gemv2T_kernel_val"),
          kernel(1, read=read, write=read, name="copy"), kernel(1, read=read, name="input_reduce_fusion_7")]
    p = tm.predict(ks, wall_ms=0.1, rows=1, c=C, here=HERE)
    assert p["gemv_rate_applied_to"] == {"gemv2T_kernel_val": 2, "input_reduce_fusion_7": 1}
    assert p["gemv_kernels"] == 3 and p["gemv_bytes"] == int(3 * read)
    assert p["gemv_t4g_ms"] == pytest.approx(3 * read / C["t4g_gemv_Bps"] * 1e3, abs=1e-3)


def test_the_gemv_calibration_is_the_layers_weight_reads_without_the_head_and_needs_them_all_profiled():
    per_layer = tm.GEMV_SOURCE["bytes"] / 100
    layers = [kernel(5, read=per_layer, name=f"nvjet_sm90_hsh_{i % 3}x8_TNT") for i in range(100)]
    head = kernel(190, read=tm.GEMV_SOURCE["lm_head_bytes"], name="nvjet_sm90_hsh_256x8_64x6_2x1_v_bz_TNT")
    others = [kernel(1, read=4 * 2**20, name="reduce_kernel"), kernel(3, read=2**21, name="fmha_cutlassF_f16")]
    g = tm.layer_gemvs([*layers, head, *others], HERE)
    assert g["layer_gemv_kernels"] == 100 and g["layer_gemv_unprofiled"] == 0
    assert g["layer_gemv_bytes"] == pytest.approx(tm.GEMV_SOURCE["bytes"], rel=1e-6)
    # the plan's layer weights read at the published rate take the published time: the constant's own arithmetic
    assert g["layer_gemv_t4g_ms"] == pytest.approx(19.789, rel=1e-3)
    cell = tm.cell_prediction({"steps": {"1": [*layers, head, *others], "8": layers}, "step_ms_1": 40.0,
                               "step_ms_8": 50.0, "here": HERE})
    cal = tm.calibration(cell)
    assert cal["published_gemv_ms_1"] == pytest.approx(19.789) and cal["gemv_t4g_ms_1"] == pytest.approx(19.789, rel=1e-3)
    assert cal["gemv_within_15pct"] and abs(cal["gemv_error_pct"]) < 0.5
    # a layer GEMV ncu did not profile: its bytes are unknown, the sum is short and the check cannot pass
    missing = [*layers[:-1], {**layers[-1], "profiled": False}, head]
    cal = tm.calibration(tm.cell_prediction({"steps": {"1": missing}, "step_ms_1": 40.0, "here": HERE}))
    assert cal["gemv_unprofiled_1"] == 1 and not cal["gemv_within_15pct"]
    # 20% too many bytes (a GEMV reading its weight more than once) is outside 15%
    heavy = [{**k, "dram__bytes_read.sum": k["dram__bytes_read.sum"] * 1.2} for k in layers]
    cal = tm.calibration(tm.cell_prediction({"steps": {"1": heavy}, "step_ms_1": 40.0, "here": HERE}))
    assert cal["gemv_error_pct"] == pytest.approx(20.0, abs=0.2) and not cal["gemv_within_15pct"]


def test_ncu_takes_every_matrix_kernel_first():
    steps = [[kernel(50, name="elementwise_long")] + [kernel(9, name="gemv2T_kernel_val")] * 3 +
             [kernel(8, name="nvjet_sm90_x")] * 2, [kernel(9, name="gemv2T_kernel_val")]]
    assert tm.heavy_names(steps, budget=7) == ["gemv2T_kernel_val", "nvjet_sm90_x", "elementwise_long"]
    assert tm.heavy_names(steps, budget=6) == ["gemv2T_kernel_val", "nvjet_sm90_x"]     # 4 + 2 launches
    assert tm.heavy_names(steps, budget=5) == ["gemv2T_kernel_val", "elementwise_long"]


# ------------------------------------------------------------------------------ round 3: the host lane
def test_the_host_lane_scales_the_hosts_work_not_its_waits():
    weights = kernel(1000, read=C["t4g_gemv_Bps"] * 10e-3)      # 10 ms on a T4G
    unmeasured = tm.predict([weights], wall_ms=8.0, rows=1, c=C, here=HERE)
    assert unmeasured["t4g_host_ms"] == pytest.approx(8.0 * C["host_factor"]) and not unmeasured["host_work_measured"]
    # 5 of the 8 ms here the host was blocked on this GPU: only 3 ms of work is scaled to Graviton2
    p = tm.predict([weights], wall_ms=8.0, rows=1, c=C, here=HERE, work_ms=3.0)
    assert p["t4g_host_ms"] == pytest.approx(3.0 * C["host_factor"]) and p["host_work_measured"]
    assert p["bound_by"] == "gpu" and p["t4g_step_ms"] == pytest.approx(10.0)
    # the traced work is an upper bound (the tracer slows the host), never more than the wall time here
    assert tm.predict([weights], 8.0, 1, C, HERE, work_ms=9.5)["t4g_host_ms"] == pytest.approx(8.0 * C["host_factor"])
    # the optimistic range takes the smaller of the work and what the GPU left uncovered (8 - 1 ms)
    lean = tm.predict([weights], 8.0, 1, C, HERE, host_all_wall=False, work_ms=9.0)
    assert lean["t4g_host_ms"] == pytest.approx(7.0 * C["host_factor"])
    cell = tm.cell_prediction({"steps": {"1": [weights]}, "step_ms_1": 40.0, "here": HERE,
                               "host_work_ms": {"1": 36.0}})
    assert cell["step1"]["host_work_ms_here"] == 36.0
    assert tm.calibration(cell)["implied_host_factor"] == pytest.approx(93.2 / 36.0, abs=0.01)


def test_the_hosts_waits_are_read_from_each_tracer():
    trace = {"traceEvents": [
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 7.0},
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 10, "dur": 1500.0},
        {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 20, "dur": 250.0},
        {"cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 30, "dur": 40.0},
        {"cat": "cpu_op", "name": "aten::item", "ts": 5, "dur": 2000.0},
        {"cat": "kernel", "name": "gemv", "ts": 12, "dur": 900.0}]}
    assert tm.torch_trace_blocked_ms(trace) == pytest.approx(1.79)
    ev = types.SimpleNamespace
    host = ev(name="/host:CPU", lines=[ev(name="python", events=[
        ev(name="PjRtStreamExecutorBuffer::BlockHostUntilReady", start_ns=100, duration_ns=2_000_000),
        ev(name="BlockHostUntilReady inner", start_ns=200, duration_ns=1_000_000),     # nested: counted once
        ev(name="ExecuteHelper", start_ns=0, duration_ns=500_000)])])
    gpu = ev(name="/device:GPU:0", lines=[ev(name="Stream #1", events=[
        ev(name="Await fusion", start_ns=0, duration_ns=9_000_000)])])               # device events: not the host
    blocked, names = tm.jax_trace_blocked_ms(ev(planes=[host, gpu]))
    assert blocked == pytest.approx(2.0)
    assert list(names)[0] == "PjRtStreamExecutorBuffer::BlockHostUntilReady" and names["ExecuteHelper"] == 0.5


# ------------------------------------------------------------------------------ round 3: the served step
def test_the_measure_builds_its_engine_as_the_server_does(monkeypatch, tmp_path):
    """The server's load and the measure's go through serving.__main__.load_engine, with serving_speed's flags;
    the measure's children get serving_speed's settings (slots, buckets, caches), the Turing paths on top."""
    import serving.__main__ as server_main
    from benchmarks import serving_speed

    calls = []
    fake = types.ModuleType("fake_runtime")
    fake.load = lambda model, **kw: calls.append((model, kw)) or "engine"
    monkeypatch.setitem(sys.modules, "fake_runtime", fake)
    monkeypatch.setitem(server_main.RUNTIMES, "fake", "fake_runtime")
    assert server_main.load_engine("fake", tmp_path) == "engine" and calls[-1] == (tmp_path, {})
    server_main.load_engine("fake", tmp_path, 1024)
    assert calls[-1] == (tmp_path, {"max_context": 1024})

    seen = []
    monkeypatch.setattr(server_main, "load_engine", lambda *a: seen.append(a) or types.SimpleNamespace())
    tm.EngineRunner("jax", tmp_path / "ckpt", tmp_path)
    flags = server_main.parse(["--runtime", "jax", "--model", "m", *serving_speed.SERVER_FLAGS])
    assert seen == [("jax", tmp_path / "ckpt", flags.max_model_len)] and flags.max_model_len == tm.CONTEXT
    env = serving_speed.served_settings(tmp_path)
    assert env["G5G_JAX_SLOTS"] == env["G5G_TORCH_SLOTS"] == str(tm.SLOTS) and "G5G_JAX_BATCHES" not in env
    assert env["G5G_JAX_BUCKETS"].split(",")[-1] == str(tm.CONTEXT)
    src = Path(tm.__file__).read_text()
    assert "env = {**served_settings(a.work), **TURING" in src          # the children's environment
    assert "Settings(" not in src and "torch_runtime import load" not in src     # no engine built any other way
    main_src = Path(server_main.__file__).read_text()
    assert "return load_engine(args.runtime, model, args.max_model_len)" in main_src


def test_every_timed_pytorch_step_is_the_one_dispatched_ahead_as_in_the_server(tiny_gemma4, monkeypatch):
    """The measure's sequences go on as a served request of many tokens does: each step of a long run takes the
    step the engine dispatched ahead (with the default max_tokens of 16, 14 of 40 steps did; the rest waited)."""
    monkeypatch.setenv("G5G_DEVICE", "cpu")
    monkeypatch.setenv("G5G_TORCH_PIPELINE", "1")           # the GPU's default, on this CPU
    runner = tm.EngineRunner("pytorch", tiny_gemma4, tiny_gemma4, at=150)    # the fixture's context is 256
    runner.begin(1)
    before = dict(runner.engine.speculation)
    for _ in range(40):
        runner.step()
    assert runner.engine.speculation == {"used": before["used"] + 40, "replaced": before["replaced"]}


def test_the_timed_steps_sit_where_the_served_ones_do(tiny_gemma4, monkeypatch, tmp_path):
    """The measure's sequences begin with serving_speed's short prompt as the servers see it and are stepped to the
    middle of its 256-token answer before a step is timed or traced: in the context bucket (JAX: one decode
    executable per bucket) where the wire's steps are. Begun at 32 positions, the JAX cell timed the 128 bucket."""
    import serving.__main__ as server_main
    from benchmarks import serving_speed
    from benchmarks.harness.serve import BUCKETS

    served = serving_speed.prompts(tiny_gemma4)["short"]["tokens"]
    assert len(tm.SERVED_PROMPT) == served == 117

    class Engine:                       # positions as an engine keeps them: a prompt of n, then one a step
        def __init__(self):
            self.pos = {}

        def start(self, slot, prompt, params):
            self.pos[slot] = len(prompt)
            return 7

        def step(self, tokens):
            for slot in tokens:
                self.pos[slot] += 1
            return dict(tokens)

    monkeypatch.setattr(server_main, "load_engine", lambda *a: Engine())
    runner = tm.EngineRunner("jax", tmp_path, tmp_path)
    for live in tm.LIVE:
        runner.begin(live)
        assert runner.engine.pos == {s: tm.SERVED_AT for s in range(live)}
    timed_end = tm.SERVED_AT + 3 * 32                   # the child's timed steps at its default --steps 32
    wire = range(served + 1, served + 256)              # the single_256 request's decode positions
    buckets = [int(b) for b in BUCKETS.split(",")]

    def bucket(pos: int) -> int:                        # the JAX engine's pick (serving_speed's profile)
        return next(b for b in buckets if b > pos)

    assert bucket(tm.SERVED_AT) == bucket(timed_end) == bucket(wire[len(wire) // 2]) == 512


def test_each_fp16_cells_wall_sits_beside_the_served_tpot_of_the_same_gpu():
    wire = {"device": "NVIDIA H100 80GB HBM3", "paths_env": {**tm.TURING, "G5G_PACKED_OTHER": "x"},
            "jax": {"single_256": {"median_tpot_ms": 3.85}, "concurrent_8x256": {"median_tpot_ms": 5.3}},
            "pytorch_batched": {"single_256": {"median_tpot_ms": 3.7}, "concurrent_8x256": {"median_tpot_ms": 7.3}}}
    here = {**HERE, "device": "NVIDIA H100 80GB HBM3"}
    raws = {"jax-fp16": {"step_ms_1": 4.0, "step_ms_8": 5.0, "here": here},
            "pytorch-fp16": {"step_ms_1": 5.2, "step_ms_8": 5.3, "here": here},
            "jax-w8a16": {"step_ms_1": 9.0, "here": here}}
    made = tm.table(raws, wire)["runtimes"]
    jax = made["jax"]["fp16"]
    assert (jax["wall_ms_here_1"], jax["wire_tpot_ms_1"], jax["wall_ms_here_8"], jax["wire_tpot_ms_8"]) == \
        (4.0, 3.85, 5.0, 5.3)
    assert jax["wall_vs_wire_pct_1"] == pytest.approx(3.9) and jax["wall_within_15pct_of_wire"]
    torch_ = made["pytorch"]["fp16"]                        # 5.2 against 3.7: +40.5%, the 8-slot server's TPOT
    assert torch_["wall_vs_wire_pct_1"] == pytest.approx(40.5) and not torch_["wall_within_15pct_of_wire"]
    assert "wire_tpot_ms_1" not in made["jax"]["w8a16"]
    other = tm.table({"jax-fp16": {**raws["jax-fp16"], "here": {**HERE, "device": "NVIDIA H200"}}}, wire)
    assert not other["runtimes"]["jax"]["fp16"]["wall_within_15pct_of_wire"]    # another GPU: no comparison
    # a served run on this GPU's own paths (2026-12-07: no XLA_FLAGS, no G5G_PACKED_*): no comparison either
    default_paths = tm.table(raws, {**wire, "paths_env": {}})["runtimes"]["jax"]["fp16"]
    assert not default_paths["wire_on_turing_paths"] and not default_paths["wall_within_15pct_of_wire"]


def test_jax_is_profiled_without_the_command_buffers_ncu_cannot_see_into(monkeypatch, tmp_path):
    """ncu profiled none of JAX fp16's kernels inside XLA's conditional command buffers (H100, 2026-12-06): the
    profiled children run without CONDITIONAL and WHILE, the user's XLA flags kept, after a warm child compiled
    that variant without ncu; other runtimes are profiled as measured."""
    env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false", "G5G_JAX_SLOTS": "8"}
    flags = dict(f.split("=", 1) for f in tm.profiled_env("jax", env)["XLA_FLAGS"].split())
    assert flags["--xla_gpu_enable_triton_gemm"] == "false"
    kinds = flags["--xla_gpu_enable_command_buffer"].split(",")
    assert "FUSION" in kinds and not {"CONDITIONAL", "WHILE"} & set(kinds)
    assert tm.profiled_env("pytorch", env) is env and tm.profiled_env("transformers", env) is env

    children = []

    def fake_child(args, child_env, result, timeout, ncu=None):
        children.append(("ncu" if ncu else "plain", "--profile" in args, child_env["XLA_FLAGS"]))
        if ncu:
            return {"error": "stop here", "child_s": 1}
        return {"child_s": 1, "steps": {str(live): [{"name": "k"}] for live in tm.LIVE}}

    monkeypatch.setattr(tm, "run_child", fake_child)
    monkeypatch.setattr(tm, "heavy_names", lambda traced, budget: ["k"])
    a = types.SimpleNamespace(steps=2, work=tmp_path, ncu_budget=10)
    for runtime in ("jax", "pytorch"):
        children.clear()
        tm.measure_cell(runtime, tmp_path, env, a, "ncu", tm.METRICS, runtime)
        plain = [c for c in children if c[0] == "plain"]
        if runtime == "jax":
            assert [c[:2] for c in children] == [("plain", False), ("plain", False), ("plain", True), ("ncu", True)]
            assert plain[-1][2] == children[-1][2] != plain[0][2]      # compiled what ncu then ran
        else:
            assert [c[:2] for c in children] == [("plain", False), ("plain", False), ("ncu", True)]
