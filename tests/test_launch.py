"""alpa_lite.runtime.launch: torchrun wrapper and process-group init (2 gloo ranks on CPU)."""
from __future__ import annotations

import json
import os
import textwrap
import time

import pytest

from alpa_lite.runtime.launch import init_distributed, torchrun

WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path

    mode, out, timeout_s = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    if mode == "sleep":  # before importing torch: a busy machine may take seconds to import it
        (out / f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
        time.sleep(120)
    import torch, torch.distributed as dist
    from alpa_lite.runtime.launch import init_distributed

    init_distributed(timeout_s=timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "ok":
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world": world, "sum": x.item(),
                                                         "omp": os.environ.get("OMP_NUM_THREADS")}))
    elif mode == "die":
        dist.barrier()
        if rank == 1:
            os._exit(3)
        # torchrun SIGTERMs the survivors when a rank fails; ignore it here so that only the
        # all-reduce's own error can end rank 0 early (a hang would last torchrun's 30 s grace).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
            status = {"error": None}
        except Exception as e:  # the behaviour under test
            status = {"error": f"{type(e).__name__}: {e}"[:500]}
        status["seconds"] = time.monotonic() - t0
        (out / "rank0.json").write_text(json.dumps(status))
        os._exit(1 if status["error"] else 0)
""")


@pytest.fixture
def worker(tmp_path):
    mod = tmp_path / "pkg_launch_worker.py"
    mod.write_text(WORKER)
    return mod


def test_two_ranks_all_reduce(worker, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    rc = torchrun(["-m", worker.stem, "ok", str(out), "30"], nproc=2,
                  env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
                  timeout_s=90)
    assert rc == 0
    for rank in (0, 1):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got["rank"] == rank and got["world"] == 2
        assert got["sum"] == 3.0  # 1 + 2
        assert got["omp"] == os.environ.get("OMP_NUM_THREADS", "1")


def test_dead_peer_fails_instead_of_hanging(worker, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    coll_timeout = 15.0
    t0 = time.monotonic()
    rc = torchrun([str(worker), "die", str(out), str(coll_timeout)], nproc=2, timeout_s=90)
    elapsed = time.monotonic() - t0
    assert rc != 0
    assert elapsed < 45, f"took {elapsed:.1f} s"
    status = json.loads((out / "rank0.json").read_text())
    assert status["error"], "rank 0's all-reduce returned although rank 1 was dead"
    assert status["seconds"] < coll_timeout + 5


def test_timeout_kills_launcher_and_ranks(worker, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(TimeoutError, match="did not finish within"):
        torchrun([str(worker), "sleep", str(out), "30"], nproc=1, timeout_s=20)
    pid = int((out / "pid0").read_text())
    for _ in range(50):
        if not _alive(pid):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"rank process {pid} survived the timeout")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only unreaped
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def test_bad_arguments():
    with pytest.raises(ValueError):
        torchrun([], nproc=2)
    with pytest.raises(ValueError):
        torchrun(["x.py"], nproc=0)


def test_init_distributed_outside_torchrun(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        init_distributed()


def test_no_rank_leaves_its_group_without_a_barrier():
    """A rank that destroys the process group while a peer still receives the last collective
    aborts that peer ("terminate called without an active exception", seen under load on
    ``alpa-lite verify``): every multi-rank script leaves through ``init_distributed``'s exit
    handler (a barrier, then the group destroyed) or destroys the group right after a barrier."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files = [p for d in ("alpa_lite", "benchmarks", "examples", "tests/workers") for p in (root / d).rglob("*.py")]
    files.append(Path(__file__))
    bare = []
    for path in files:
        lines = [ln.split("#")[0].strip() for ln in path.read_text().splitlines()]
        lines = [ln for ln in lines if ln]
        for i, line in enumerate(lines):
            if line.startswith("dist.destroy_process_group()") and lines[i - 1] not in ("dist.barrier()", "finally:"):
                bare.append(f"{path.relative_to(root)}: {lines[i - 1]!r} before it")
    assert not bare, bare
    assert len(files) > 20
