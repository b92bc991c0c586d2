"""The first hour (issue 15): every ```bash and ```python block of README.md and docs/*.md runs, and
what its comment promises is asserted; every `--help` ends with an example; the dependencies are
what the package imports.

Conventions of the docs (README.md says them too):

- ```bash: one command per line; the text after ``#`` is its promise. ``alpa-lite ...`` runs as
  ``python -m alpa_lite.cli ...`` with this interpreter, which stands in for ``.venv`` (so
  ``scripts/setup.sh && `` is dropped; the set-up itself is checked by
  :func:`test_setup_and_constraints_match_pyproject`, as running it needs the network). Every
  command runs in one temporary directory, in document order (``examples/`` linked into it), so
  output files land there and a later command reads an earlier one's (``cluster.json``); a
  command given in two docs runs once.
- ```python: runs as written in a fresh process in that directory. A first line ``# NAME.py, run
  on every rank: alpa-lite run --nproc 4 NAME.py`` runs it so; ``# continues NAME.py above`` runs
  it appended to that block.
- ``# needs: WHAT`` as a block's first line (or a command's comment): skipped here, the reason
  shown (``cuda``, ``network``, ``hours``).
- ```text, or a fence without a language: output, diagrams, synopses; not run.

Shortened here, and only here (CI time: the whole file takes a few minutes on 2 cores): the
README's 200-step training job runs 12 steps, ``train --model gpt2-hf`` 3 steps instead of its
default 200, and ``profile --nproc 4`` sweeps 3 message sizes with 1 warm-up and 3 repeats; the
checks below say so where they apply. Every command in the docs has exactly one check in
``CHECKS`` (a new command without one fails :func:`test_every_command_has_a_check`).
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from alpa_lite import Plan
from alpa_lite.core.mesh import PRESETS, ClusterSpec

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = ("bash", "python")
NOT_RUN = ("", "text")
TIMEOUT = 600


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    code: str

    @property
    def needs(self) -> str | None:
        m = re.match(r"\s*# needs: (.+)", self.code)
        return m.group(1).strip() if m else None


def blocks(path: Path) -> list[Block]:
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m:
            j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
            out.append(Block(path.name, i + 1, m.group(1), "\n".join(lines[i + 1:j]) + "\n"))
            i = j
        i += 1
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]


def commands() -> list[tuple[Block, str, str]]:
    """(block, command as run, its comment) of every bash line; setup and .venv/bin/ dropped."""
    out = []
    for b in ALL:
        if b.lang != "bash" or b.needs:
            continue
        for line in b.code.splitlines():
            cmd, _, comment = line.partition(" #")
            cmd = cmd.strip().removeprefix("scripts/setup.sh && ").replace(".venv/bin/", "")
            if cmd and not cmd.startswith("#"):
                out.append((b, cmd, comment.strip()))
    return out


COMMANDS = commands()
UNIQUE = list({cmd: (b, cmd, comment) for b, cmd, comment in reversed(COMMANDS)}.values())[::-1]  # each runs once


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "COLUMNS": "200", **(env or {})}  # rich wraps at 80 columns when not on a terminal
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)
    assert r.returncode == 0, f"{shlex.join(cmd)} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def alpa_lite(args: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "alpa_lite.cli", *args], cwd, **kw)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    (d / "examples").symlink_to(ROOT / "examples")
    return d


# ------------------------------------------------------------------------------- the checks
# Each takes (workdir, args after "alpa-lite") and runs the command, shortened where said.


def _plan_json(d, args):
    r = alpa_lite(args, d)
    plan = Plan.from_json(str(d / "plan.json"))
    assert plan.mesh.shape == (2, 4) and plan.mesh.cluster == "a100" and plan.step_seconds > 0
    assert "step time (predicted)" in r.stdout and "plan written to plan.json" in r.stdout


def _mlp_budget(d, args):
    r = alpa_lite(args, d)
    assert "step time (predicted)" in r.stdout and "collectives per training step" in r.stdout


def _mlp_free(d, args):
    r = alpa_lite(args, d)
    assert "step time (predicted)" in r.stdout and (d / "free.json").exists()


def _diff(d, args):  # the two plans of the commands above (made here when run alone)
    for name, budget in (("free.json", []), ("tight.json", ["--memory-budget", "0.002"])):
        if not (d / name).exists():
            alpa_lite(["plan", "mlp", "--mesh", "1x4", "--cluster", "unit", *budget, "--json", name], d)
    r = alpa_lite(args, d)
    # without a budget the MLP is data parallel; at 2 MB its weights are Megatron-split
    assert "parameter specs changed" in r.stdout and "RR" in r.stdout and "S1R" in r.stdout
    assert "step time (predicted)" in r.stdout and "collectives:" in r.stdout


def _explain(d, args):
    r = alpa_lite(args, d)
    chosen = [line for line in r.stdout.splitlines() if "│ * │" in line]
    assert len(chosen) == 1 and "k:S1" in chosen[0]  # why this strategy: the chosen row is marked


def _train_gpt2_hf(d, args):  # default 200 steps; 3 here
    r = alpa_lite([*args, "--steps", "3", "--out", "hf"], d)
    summary = json.loads((d / "hf" / "summary.json").read_text())
    assert summary["model"] == "gpt2-hf" and summary["processes"] == 4 and summary["steps"] == 3
    assert "validation" in r.stdout


def _pipeline_chart(d, args):
    r = alpa_lite(args, d)
    assert re.search(r"pipeline: \d+ stages?, 1f1b", r.stdout) and "schedule chart written to step.png" in r.stdout
    assert (d / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _verify(d, args):
    r = alpa_lite(args, d)  # exit 0: equal
    assert "equal to one process" in r.stdout


def _run_report(d, args):
    r = alpa_lite(args, d)
    losses = [float(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 10 and losses[-1] < losses[0]  # rank 0 prints; the same batch: the loss falls
    assert "specs" in r.stdout
    title = "predicted vs measured: mesh 2x2, 5 timed steps after 2 warm-up"  # rich wraps a title to its table
    assert title in " ".join(r.stdout.split())


def _profile_2x2(d, args):  # 3 sizes, 1 warm-up, 3 repeats here
    alpa_lite([*args, "--sizes", "4K", "256K", "4M", "--warmup", "1", "--repeats", "3"], d)
    spec = ClusterSpec.load(d / "cluster.json")
    assert spec.num_devices == 4 and set(spec.mesh_links) == {"2x2"} and spec.kernel_flops


def _plan_profiled(d, args):
    r = alpa_lite(args, d)  # a mesh (2x4) larger than the profiled one (2x2)
    spec = ClusterSpec.load(d / "cluster.json")
    assert spec.name in r.stdout and "step time (predicted)" in r.stdout


def _profile_one(d, args):
    alpa_lite(args, d)
    spec = ClusterSpec.load(d / "cpu.json")
    base = PRESETS["cpu-gloo"]
    assert spec.measurements["network_from"] == "cpu-gloo" and spec.measurements["world_size"] == 1
    assert (spec.intra_node, spec.inter_node, spec.num_devices) == (base.intra_node, base.inter_node, base.num_devices)
    flops = spec.measurements["compute"]["matmul_flops"]
    assert set(flops) >= {"float32", "bfloat16"} and spec.peak_flops == flops["float32"]
    sizes = spec.measurements["compute"]["matmul_sizes"]  # float32 at --matmul-n; others may be smaller
    assert sizes["float32"] == 1024 and set(sizes) == set(flops) and all(8 <= n <= 1024 for n in sizes.values())
    assert set(spec.kernel_flops) == {"attention", "pointwise"} and spec.mem_bandwidth > 1e8


def _train_calibration(d, args):
    r = alpa_lite([*args, "--out", "one"], d, env={"ALPA_LITE_REPORT_JSON": str(d / "report.json")})
    record = json.loads((d / "report.json").read_text())
    assert record["mesh"] == [1, 1] and record["timed_steps"] == 5 and "predicted vs measured" in r.stdout
    summary = json.loads((d / "one" / "summary.json").read_text())
    assert summary["processes"] == 1 and summary["mesh"] == "1x1" and summary["cluster"].startswith("profiled-cpu")


def _main_job(d, args):  # 200 steps in the README; 12 here
    assert args[args.index("--steps") + 1] == "200"
    args = [*args[:args.index("--steps")], "--steps", "12", "--out", "main"]
    r = alpa_lite(args, d)
    summary = json.loads((d / "main" / "summary.json").read_text())
    assert summary["processes"] == 4 and summary["mesh"] == "2x2" and summary["plan_file"] is None
    assert summary["final_loss_avg"] < summary["first_loss"]  # it learns
    assert len((d / "main" / "log.jsonl").read_text().splitlines()) == 12 and "validation" in r.stdout


CHECKS = {
    "alpa-lite train --model gpt-tiny --nproc 4 --mesh 2x2 --steps 200": _main_job,
    "python -m pytest -q": None,  # the suite this file belongs to
    "alpa-lite plan gpt3-2.6b --mesh 2x4 --cluster a100 --batch 16 --json plan.json": _plan_json,
    "alpa-lite plan mlp --mesh 1x4 --cluster unit --memory-budget 0.002 --json tight.json": _mlp_budget,
    "alpa-lite plan mlp --mesh 1x4 --cluster unit --json free.json": _mlp_free,
    "alpa-lite diff free.json tight.json": _diff,
    "alpa-lite plan mlp --mesh 1x4 --cluster unit --memory-budget 0.002 --explain linear_1": _explain,
    "alpa-lite train --model gpt2-hf --nproc 4 --mesh 2x2": _train_gpt2_hf,
    "alpa-lite plan gpt3-2.6b --mesh 1x8 --batch 64 --pipeline auto --microbatches 16 --schedule-chart step.png":
        _pipeline_chart,
    "alpa-lite verify llama --mesh 2x2 --seq 8 --steps 3": _verify,
    "alpa-lite run --report --nproc 4 examples/parallel_mlp.py": _run_report,
    "alpa-lite profile --nproc 4 --mesh 2x2 --out cluster.json": _profile_2x2,
    "alpa-lite plan gpt-tiny --mesh 2x4 --cluster cluster.json": _plan_profiled,
    "alpa-lite profile --nproc 1 --out cpu.json": _profile_one,
    "alpa-lite train --nproc 1 --mesh 1x1 --cluster cpu.json --steps 10 --report": _train_calibration,
}


def test_every_command_has_a_check():
    found = [cmd for _, cmd, _ in COMMANDS]
    assert sorted(set(found)) == sorted(CHECKS), "a doc command without a check, or a check without its command"


def test_fences_have_known_languages():
    bad = [f"{b.doc}:{b.line} ```{b.lang}" for b in ALL if b.lang not in RUN + NOT_RUN]
    assert not bad, f"fences must be bash, python or text (or bare for output): {bad}"


def _normalized(python_cmd: str) -> str:
    return python_cmd.replace(".venv/bin/python", "python")


@pytest.mark.parametrize("block,cmd,comment", UNIQUE, ids=[f"{b.doc}:{b.line}:{c[:60]}" for b, c, _ in UNIQUE])
def test_command(workdir, block, cmd, comment):
    check = CHECKS[cmd]
    if check is None:
        pytest.skip(f"{cmd}: the test suite itself")
    assert cmd.startswith("alpa-lite "), cmd
    check(workdir, shlex.split(cmd)[1:])


# ------------------------------------------------------------------------------ python blocks

def python_programs() -> list[tuple[Block, str, list[str]]]:
    """(block, source, how to run it) of every python block; continuations appended to their start."""
    out, named = [], {}
    for b in ALL:
        if b.lang != "python" or b.needs:
            continue
        first = b.code.splitlines()[0]
        source = b.code
        m = re.match(r"# continues (\S+\.py) above", first)
        if m:
            start = named[(b.doc, m.group(1))]
            source, how = start[1] + "\n" + b.code, start[2]
        else:
            m = re.match(r"# (\S+\.py), run on every rank: alpa-lite run --nproc (\d+) \1$", first)
            how = ["-m", "alpa_lite.cli", "run", "--nproc", m.group(2), m.group(1)] if m else ["program.py"]
            if m:
                named[(b.doc, m.group(1))] = (b, source, how)
        out.append((b, source, how))
    return out


PROGRAMS = python_programs()


@pytest.mark.parametrize("block,source,how", PROGRAMS, ids=[f"{b.doc}:{b.line}" for b, _, _ in PROGRAMS])
def test_python_block(workdir, block, source, how):
    name = how[-1]
    (workdir / name).write_text(source)
    r = run([sys.executable, *how], workdir)
    if 'plan.to_json("plan.json")' in source:  # prints a spec, the step time and the memory; writes the plan
        plan = Plan.from_json(str(workdir / "plan.json"))
        assert plan.mesh.shape == (2, 4) and str(plan.param_specs["blocks.0.ffn.fc.weight"]) in r.stdout
    if "alpa_lite.verify(" in source:  # rank 0 prints the comparison table
        assert "verify: equal to one process" in r.stdout


# ------------------------------------------------------------------------ what the docs promise


def test_missing_targets_says_to_pass_targets():
    import torch

    import alpa_lite
    from alpa_lite.core.capture import CaptureError

    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    mesh = alpa_lite.LogicalMesh((1, 2), cluster="unit")
    with pytest.raises(CaptureError, match=r"with 0 target\(s\).*targets=\(y, \.\.\.\)"):
        alpa_lite.plan(model, (x,), mesh, loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out, y))
    with pytest.raises(CaptureError, match=r"with 2 target\(s\)"):
        alpa_lite.plan(model, (x,), mesh, loss_fn=lambda out, y: out.sum(), targets=(y, y))
    plan = alpa_lite.plan(model, (x,), mesh, loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out, y),
                          targets=(y,))
    assert plan.step_seconds > 0


def test_train_records_what_ran(workdir):
    if not (workdir / "one" / "summary.json").exists():  # written by the README's one-device run above
        alpa_lite(["train", "--nproc", "1", "--mesh", "1x1", "--steps", "2", "--out", "one"], workdir)
    alpa_lite(["train", "--nproc", "1", "--mesh", "1x1", "--steps", "2", "--plan", "one/plan.json", "--out", "two"],
              workdir)
    a, b = (json.loads((workdir / x / "summary.json").read_text()) for x in ("one", "two"))
    for s in (a, b):
        assert (s["processes"], s["mesh"], s["device"], s["backend"], s["dtype"]) == (1, "1x1", "cpu", "gloo",
                                                                                   "float32")
    assert a["plan_file"] is None and b["plan_file"] == "one/plan.json" and a["param_specs"] == b["param_specs"]


def test_schedule_chart_needs_a_pipeline(tmp_path):
    r = subprocess.run([sys.executable, "-m", "alpa_lite.cli", "plan", "mlp", "--schedule-chart", "c.png"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert r.returncode == 2 and "add --pipeline auto" in r.stderr and not (tmp_path / "c.png").exists()


# ----------------------------------------------------------------------------- --help examples


def test_every_subcommand_help_ends_with_a_readme_example():
    from alpa_lite.cli import EXAMPLES, build_parser

    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(subcommands) == set(EXAMPLES)
    readme = {cmd for b, cmd, _ in COMMANDS if b.doc == "README.md"}
    for name, sub in subcommands.items():
        text = sub.format_help()
        assert "example" in text.split("options:")[-1]
        for example in EXAMPLES[name]:
            assert example in text and example.startswith(f"alpa-lite {name} ")
            assert example in readme, f"{example!r}: help examples are README commands (run above)"
            parser.parse_args(shlex.split(example)[1:])  # every option it uses exists


# ------------------------------------------------------------------------------- dependencies


def _third_party_imports() -> set[str]:
    std = set(sys.stdlib_module_names) | {"alpa_lite"}
    found = set()
    for path in (ROOT / "alpa_lite").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module.split(".")[0])
    return found - std


def test_required_dependencies_are_what_the_package_imports():
    project = pytest.importorskip("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[<>=\[ ;]", req)[0].lower()  # noqa: E731
    required = {name(r) for r in project["dependencies"]}
    extras = {k: {name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    # psutil: /proc/meminfo without it; safetensors: only for a .safetensors export (save_full)
    optional = {"matplotlib": "plot", "transformers": "hf", "psutil": None, "safetensors": None}
    imports = _third_party_imports()
    assert required == imports - set(optional), "required = imported everywhere it is needed"
    for module, extra in optional.items():
        assert module in imports and (extra is None or module in extras[extra])
    assert extras["highs"] == {"highspy"}  # PuLP's HiGHS interface imports it
    assert extras["all"] == {"alpa-lite"} and "[plot,hf,highs]" in project["optional-dependencies"]["all"][0]


def test_setup_and_constraints_match_pyproject():
    project = pytest.importorskip("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    tested = {"torch", "pulp", "highspy", "numpy", "rich", "matplotlib", "transformers", "pytest",
              "pytest-xdist", "networkx"}  # required + dev
    assert set(pins) == tested and all(re.fullmatch(r"\d+(\.\d+)+", v) for v in pins.values())
    dev = project["optional-dependencies"]["dev"]
    assert "[plot,hf,highs]" in dev[0]
    assert {re.split(r"[<>=]", r)[0] for r in dev[1:]} == {"pytest", "pytest-xdist", "networkx"}
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert '-c constraints.txt -e ".[dev]"' in setup
    checked = set(re.search(r'import (alpa_lite, [^"]+)"', setup).group(1).split(", "))
    assert checked == {"alpa_lite"} | {{"pytest-xdist": "xdist"}.get(p, p) for p in tested}
