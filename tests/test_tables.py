"""What the commands print and plot fits a narrow terminal without losing anything: every table goes through
g5g/console.py's print_table (cells fold, never "…"), and a plot names long run labels without overlapping them."""
from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from g5g import inspect as inspector
from g5g.commands import bench as bench_cmd
from g5g.commands import inspect as inspect_cmd

REPO = Path(__file__).resolve().parent.parent
RUNS = ["jax-g5g-cu130-sm75-fp16", "pytorch-g5g-cu130-sm75-fp16", "vllm-g5g-cu130-sm75-fp16",
        "pytorch-g4dn-cu130-sm75-w4a16", "jax-cpu-0.10.2-bucket-ladder"]


def result(i: int) -> dict:
    return {"completed": 16, "failed": 0, "mode": "stream", "label": RUNS[i], "duration": 12.3456 + i,
            "output_throughput": 43.1 * (i + 1), "median_ttft_ms": 123.45 + i, "median_tpot_ms": 23.2 + i,
            "p99_itl_ms": 31.0 + i, "boot": {"first_answer_s": 76.4 + i}}


def columns(text: str) -> list[str]:
    """Each column's text over every line (header and body), pieces joined: a folded cell reads whole again."""
    cols: dict[int, str] = {}
    for line in text.splitlines():
        parts = re.split("[│┃]", line)
        for i, part in enumerate(parts[1:-1]):
            cols[i] = cols.get(i, "") + part.strip()
    return list(cols.values())


def compare_output(tmp_path: Path, env: dict) -> str:
    files = []
    for i in range(len(RUNS)):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(result(i)))
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "bench", "compare", *map(str, files)],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_bench_compare_at_60_columns_in_a_log_keeps_every_cell_whole(tmp_path):
    out = compare_output(tmp_path, {**os.environ, "COLUMNS": "60", "TERM": "dumb"})
    assert "…" not in out
    for label in RUNS:
        assert label in out, out
    assert "43.10" in out and "215.50" in out and "median TTFT (ms)" in out


def test_bench_compare_in_a_60_column_terminal_folds_cells(tmp_path, monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(bench_cmd, "console", Console(file=buf, width=60, force_terminal=True, color_system=None))
    for i in range(len(RUNS)):
        (tmp_path / f"{i}.json").write_text(json.dumps(result(i)))
    assert bench_cmd.compare([str(tmp_path / f"{i}.json") for i in range(len(RUNS))], None) == 0
    out = buf.getvalue()
    assert "…" not in out and max(map(len, out.splitlines())) <= 60
    cols = columns(out)
    assert len(cols) == 1 + len(RUNS)
    for label, col in zip(RUNS, cols[1:]):
        assert col.startswith(label), (label, col)
    assert "medianTTFT(ms)" in cols[0].replace(" ", "")


INSPECTED = {"image": "registry.example:5000/g5g-images:vllm-0.33.0-cu130-sm75", "digest": "sha256:" + "a" * 64,
             "backend": "http", "arch": "7.5",
             "platforms": {p: inspector.platform_entry({"config": {"Env": [f"TORCH_CUDA_ARCH_LIST={a}"]}}, "7.5")
                           for p, a in (("linux/amd64", "7.5 8.0 8.6 8.9 9.0 10.0 12.0"),
                                        ("linux/arm64", "8.0 8.7 8.9 9.0 10.0 11.0 12.0"))}}


@pytest.mark.parametrize("terminal", [True, False])
def test_inspect_at_60_columns_keeps_platforms_and_digest_whole(terminal, monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(inspect_cmd, "console", Console(file=buf, width=60, force_terminal=terminal, color_system=None))
    monkeypatch.setattr(inspector, "inspect", lambda image, **kw: INSPECTED)
    args = argparse.Namespace(images=[INSPECTED["image"]], arch="7.5", platform=None, backend="http", insecure=False,
                              probe=False, json=False)
    assert inspect_cmd.run(args) == 1  # arm64 lacks 7.5
    out = buf.getvalue()
    assert "…" not in out
    platforms = columns(out)[0]
    assert "linux/amd64" in platforms and "linux/arm64" in platforms, out
    assert INSPECTED["digest"] in (out.replace("\n", "").replace(" ", "") if terminal else out)


def test_every_table_goes_through_print_table():
    """A table printed any other way is cut to the console's width (rich's default overflow is "…")."""
    for path in (REPO / "g5g").rglob("*.py"):
        text = path.read_text()
        if "Table(" in text:
            assert "print_table(" in text, path
            assert not re.search(r"console\.print\((t|table\(.*\)|_table\(.*\)|result_table\(.*\))\)", text), path


def test_compare_plot_names_five_long_runs_without_overlap():
    import matplotlib.pyplot as plt

    fig = bench_cmd.plot([result(i) for i in range(len(RUNS))])
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        texts = [t for t in fig.findobj(plt.Text) if t.get_visible() and t.get_text() in RUNS]
        assert {t.get_text() for t in texts} == set(RUNS)   # every run is named
        boxes = [t.get_window_extent(renderer) for t in texts]
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), (a, b)
    finally:
        plt.close(fig)
