"""Planning progress on a terminal: each phase the planner reports (capture, strategies, the ILP;
for a pipeline each microbatch count's capture, every submesh's stage costs, the stage DP and the
stage plans) as a line with its elapsed time, under a live spinner naming the current phase.
Quiet when the console is not a terminal (a pipe, a log file, a test)."""
from __future__ import annotations

import time

from rich.console import Console

PHASES = {"capture": "capturing the model (torch.export)", "strategies": "enumerating sharding strategies",
          "ilp": "solving the intra-op ILP"}


class PlanProgress:
    """``with PlanProgress(console) as progress: plan(..., progress=progress)``.

    ``progress(message)`` starts a phase (the short names of ``api.plan`` are spelled out); the
    phase before it is printed with its seconds. Leaving the block prints the last phase and the
    total. Nothing is printed when ``console.is_terminal`` is False.
    """

    def __init__(self, console: Console):
        self.console = console
        self.live = console.is_terminal
        self._status = None
        self._phase: tuple[str, float] | None = None

    def __enter__(self) -> "PlanProgress":
        self._t0 = time.perf_counter()
        if self.live:
            self._status = self.console.status("planning")
            self._status.__enter__()
        return self

    def __call__(self, message: str) -> None:
        self._close_phase()
        self._phase = (PHASES.get(message, message), time.perf_counter())
        if self._status is not None:
            self._status.update(f"{self._phase[0]}  [dim](elapsed {time.perf_counter() - self._t0:.1f} s)[/]")

    def _close_phase(self) -> None:
        if self._phase is not None and self.live:
            name, start = self._phase
            self.console.print(f"[green]done[/] {name} [dim]{time.perf_counter() - start:.2f} s[/]")
        self._phase = None

    def __exit__(self, *exc) -> None:
        self._close_phase()
        if self._status is not None:
            self._status.__exit__(*exc)
            if exc[0] is None:
                self.console.print(f"[green]planned[/] in {time.perf_counter() - self._t0:.2f} s")
