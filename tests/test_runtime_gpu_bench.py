"""benchmarks/runtime_gpu.py still runs: its CPU smoke mode (a tiny GPT, a few steps) times every
runner of both tables (world size 1, and DP vs DDP on 2 gloo ranks) and writes the doc. Speed
itself is measured by the benchmark, not asserted here."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_writes_both_tables(tmp_path):
    out = tmp_path / "runtime_gpu.md"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "runtime_gpu.py"), "--smoke", "--dp-ranks", "2",
                        "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    text = out.read_text()
    assert "## One device (world size 1, mesh 1x1)" in text and "## Data parallel over 2 ranks" in text
    rows = re.findall(r"^\| gpt-tiny \| fp32 \| ([^|]+) \| ([0-9.]+) \| ±([0-9.]+)% \| ([0-9.]+) \|", text, re.M)
    assert [label.strip() for label, *_ in rows] == ["eager PyTorch", "torch.compile", "alpa-lite interpreted",
                                                     "DDP", "alpa-lite DP"]
    assert all(float(ms) > 0 for _, ms, _, _ in rows)
    assert [float(ratio) for label, _, _, ratio in rows if label.strip() in ("eager PyTorch", "DDP")] == [1.0, 1.0]
