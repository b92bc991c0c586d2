"""Process launch helpers shared by ``alpa-lite profile`` and the runtime.

We never write our own launcher: :func:`torchrun` starts PyTorch's own elastic launcher
(``python -m torch.distributed.run``, the module behind the ``torchrun`` command) in a
subprocess, and :func:`init_distributed` is what each launched rank calls first.
"""
from __future__ import annotations

import atexit
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def default_device():
    """This rank's device: the current CUDA device when CUDA is available, else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def job_timeout() -> datetime.timedelta:
    """The collective timeout of the default process group (``init_process_group(timeout=...)``,
    ``init_distributed``'s ``timeout_s``). A group made later without a timeout of its own (a
    ``DeviceMesh``'s axis groups, ``new_group``) gets torch's default (30 minutes on gloo), not
    this one."""
    import torch
    import torch.distributed as dist

    return dist.group.WORLD._get_backend(torch.device(default_device().type)).options._timeout


def init_distributed(timeout_s: float = 120.0) -> None:
    """Initialize the default ``torch.distributed`` process group from torchrun's env vars.

    Does nothing when the default group already exists. The backend is ``nccl`` when CUDA is
    available (after ``torch.cuda.set_device(LOCAL_RANK)``), else ``gloo``.

    Args:
        timeout_s: collective timeout, seconds. A collective whose peer died or never
            arrives fails with an error after at most this long instead of hanging forever
            (gloo usually notices a closed connection much sooner).

    Raises:
        RuntimeError: when the process was not started by torchrun (env vars missing).
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_distributed: not started by torchrun (missing env var(s) {', '.join(missing)}); "
                           "launch with alpa_lite.runtime.launch.torchrun or `torchrun --nproc-per-node N ...`")
    cuda = torch.cuda.is_available()
    if cuda:
        local_rank = int(os.environ["LOCAL_RANK"])
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"init_distributed: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} "
                               "CUDA device(s) visible; launch at most one rank per GPU")
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    atexit.register(_shut_down)
    sys.excepthook = _noting_failure(sys.excepthook)
    _start_heartbeat()


_failed = False  # an uncaught exception ends this rank: ``_shut_down`` waits for no peer


def _noting_failure(hook):
    """``hook`` (``sys.excepthook``), noting first that an uncaught exception ends this rank."""
    def excepthook(*exc_info):
        global _failed
        _failed = True
        hook(*exc_info)
    return excepthook


HEARTBEAT_S = 1.0
"""Seconds between two beats of a rank's heartbeat (``init_distributed``)."""
_heartbeat_store = None  # this rank's reader of the job's heartbeats, once ``init_distributed`` started its own
_heartbeat_stop = threading.Event()
_heartbeat_thread: threading.Thread | None = None


def _heartbeat_client():
    """A client of the job's key-value store (torchrun's, at ``MASTER_ADDR:MASTER_PORT``), under
    the heartbeat keys."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=10))
    return dist.PrefixStore("alpa_lite/heartbeat", store)


def _start_heartbeat() -> None:
    """Count this rank's heartbeat in the job's store every ``HEARTBEAT_S`` seconds, from a
    daemon thread, until the store goes (the job ends): ``silent_ranks`` tells from it which
    ranks died or stopped when a collective fails."""
    import torch.distributed as dist

    global _heartbeat_store, _heartbeat_thread
    try:
        key, beats, reader = str(dist.get_rank()), _heartbeat_client(), _heartbeat_client()
    except Exception:  # no store to reach (not torchrun's): no heartbeat, and failures name no silent rank
        return

    def beat():
        n = 0
        while True:
            n += 1
            try:
                beats.set(key, str(n))
            except Exception:  # the store is gone: the job is ending
                return
            if _heartbeat_stop.wait(HEARTBEAT_S):
                return

    _heartbeat_thread = threading.Thread(target=beat, name="alpa-lite heartbeat", daemon=True)
    _heartbeat_thread.start()
    _heartbeat_store = reader


def silent_ranks(wait_s: float = 2.5 * HEARTBEAT_S) -> list[int] | None:
    """The ranks of the job whose heartbeat (``init_distributed``) did not advance in ``wait_s``
    seconds: dead (exited, killed) or stopped, where a live rank's daemon thread beats every
    ``HEARTBEAT_S`` even while it waits in a collective. Takes ``wait_s`` seconds; None when
    unknown (this rank started no heartbeat, or the store is gone)."""
    import torch.distributed as dist

    if _heartbeat_store is None:
        return None
    keys = [str(r) for r in range(dist.get_world_size())]

    def read():
        return {k: _heartbeat_store.get(k) if _heartbeat_store.check([k]) else None for k in keys}

    try:
        before = read()
        time.sleep(wait_s)
        after = read()
    except Exception:  # the store is gone
        return None
    return [int(k) for k in keys if before[k] == after[k]]


def _shut_down() -> None:
    """At exit, the group ``init_distributed`` made: a barrier, then destroy it, so that no rank
    leaves while a peer still receives the last collective (gloo's receiving thread then aborts
    the peer: "terminate called without an active exception"). No barrier when an uncaught
    exception ends the rank: its peers wait in other collectives, so the barrier would hold the
    rank (and them, and the launcher's teardown) for the whole collective timeout. The heartbeat
    stops first: a daemon thread inside the store's client as the process ends aborted it
    ("terminate called without an active exception", once in a full test run)."""
    import torch.distributed as dist

    if _heartbeat_thread is not None:  # joined: no thread may be inside the store's client as the process ends
        _heartbeat_stop.set()
        _heartbeat_thread.join(timeout=15)
    if dist.is_initialized():
        try:
            if not _failed:
                dist.barrier()
        finally:
            dist.destroy_process_group()


def torchrun(target: Sequence[str], nproc: int, env: Mapping[str, str] | None = None,
             timeout_s: float | None = None, *, stdout: IO | int | None = None,
             stderr: IO | int | None = None) -> int:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node N <target...>``.

    Args:
        target: ``["-m", "pkg.module", args...]`` or ``["script.py", args...]``.
        nproc: number of ranks (processes) on this machine.
        env: extra environment variables for the launcher and its ranks (on top of this
            process's environment). ``OMP_NUM_THREADS=1`` unless set here or in the
            environment already.
        timeout_s: wall-clock limit, seconds; ``None`` waits forever.
        stdout, stderr: passed to ``subprocess.Popen`` (e.g. an open log file); default:
            inherit ours.

    Returns:
        The launcher's exit code (0 when every rank succeeded; non-zero when any failed).

    Raises:
        ValueError: on an empty target or ``nproc < 1``.
        TimeoutError: after ``timeout_s``; the launcher and its ranks have been killed.
    """
    target = [str(t) for t in target]
    if not target or int(nproc) < 1:
        raise ValueError(f"torchrun needs a target and nproc >= 1, got target={target!r}, nproc={nproc}")
    full_env = dict(os.environ)
    full_env.update({k: str(v) for k, v in (env or {}).items()})
    full_env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(int(nproc)),
           *target]
    # A session of its own, so that a timeout can end the launcher without touching our group.
    proc = subprocess.Popen(cmd, env=full_env, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        raise TimeoutError(f"torchrun {' '.join(target)} (nproc={nproc}) did not finish within {timeout_s} s; "
                           "the launcher and its ranks were killed") from None
    except BaseException:  # KeyboardInterrupt and friends: leave no ranks behind
        _kill_tree(proc)
        raise


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux ``/proc``; empty elsewhere)."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _kill_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End the launcher we started and its ranks (each rank runs in a session of its own).

    SIGTERM to the launcher's process group first (torchrun then stops its ranks), SIGKILL to
    whatever of the launcher and its descendants is left after ``grace_s`` seconds.
    """
    tree, todo = [], [proc.pid]
    while todo:  # the ranks and their helpers, recorded before the launcher can exit
        pid = todo.pop()
        tree.append(pid)
        todo += _children(pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in tree[1:]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
