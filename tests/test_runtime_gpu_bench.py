"""benchmarks/runtime_gpu.py still runs: its CPU smoke mode (a tiny GPT, a few steps) times every
runner of both tables (world size 1, and DP vs DDP and TP vs DTensor on 2 gloo ranks) and writes the doc. Speed
itself is measured by the benchmark, not asserted here."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_writes_both_tables(tmp_path):
    out = tmp_path / "runtime_gpu.md"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "runtime_gpu.py"), "--smoke", "--dp-ranks", "2",
                        "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    text = out.read_text()
    assert "## One device (world size 1, mesh 1x1)" in text and "## DP and TP over 2 ranks" in text
    rows = re.findall(r"^\| gpt-tiny \| fp32 \| ([^|]+) \| ([0-9.]+) \| ±([0-9.]+)% \| ([0-9.]+) \| ([^|]+) \|",
                      text, re.M)
    assert [(label.strip(), vs.strip()) for label, _, _, _, vs in rows] == [
        ("eager PyTorch", "-"), ("torch.compile", "eager PyTorch"), ("alpa-lite interpreted", "eager PyTorch"),
        ("alpa-lite compiled", "torch.compile"), ("DDP", "-"), ("alpa-lite DP", "DDP"), ("DTensor TP", "-"),
        ("alpa-lite Megatron TP", "DTensor TP")]
    ms = {label.strip(): float(t) for label, t, *_ in rows}
    assert all(t > 0 for t in ms.values())
    for label, t, _, ratio, vs in rows:  # each ratio is to the runner it names
        base = ms.get(vs.strip(), float(t))
        assert float(ratio) == pytest.approx(float(t) / base, rel=5e-3)


def test_interpreter_overhead_prints_its_table(tmp_path):
    """benchmarks/interpreter_overhead.py runs a few steps and prints both runners, each ratio
    its CPU time over eager's."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "interpreter_overhead.py"), "--steps", "4",
                        "--layers", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = re.findall(r"^\| ([^|]+) \| ([0-9.]+) \| ±[0-9]+% \| ([0-9.]+) \| (-?[0-9.]+) \| (-?[0-9.]+) \|$",
                      r.stdout, re.M)
    assert [label.strip() for label, *_ in rows] == ["eager PyTorch", "alpa-lite interpreted"]
    (_, eager, one, *_), (_, interpreted, ratio, over, _) = rows
    assert float(eager) > 0 and float(one) == 1.0
    assert float(ratio) == pytest.approx(float(interpreted) / float(eager), rel=5e-3, abs=1e-3)
    assert float(over) == pytest.approx(float(interpreted) - float(eager), abs=2e-3)
