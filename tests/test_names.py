"""Every name a function of the package, a benchmark or a test worker reads from module scope exists there.

A benchmark's worker imports inside its body and runs only on the ranks it launches, so a name whose import
was dropped (``parallelize_module`` once in ``benchmarks/runtime_cpu.py``) fails only when that row is run.
Read with ``symtable``: a name a function neither binds nor finds in an enclosing function is looked up in
the module's globals, then builtins; either must hold it.
"""
import builtins
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "alpa_lite").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "tests" / "workers").glob("*.py"))


def _unbound(path: Path):
    top = symtable.symtable(path.read_text(), str(path), "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()} | set(dir(builtins))
    defined |= {"__file__", "__name__", "__doc__", "__spec__", "__builtins__", "__package__", "__loader__"}
    stack = list(top.get_children())
    while stack:
        table = stack.pop()
        stack.extend(table.get_children())
        for s in table.get_symbols():
            if s.is_global() and s.is_referenced() and s.get_name() not in defined:
                yield f"{table.get_name()} (line {table.get_lineno()}): {s.get_name()}"


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_every_global_a_function_reads_is_defined(path):
    assert list(_unbound(path)) == []


def test_the_check_sees_a_dropped_function_local_import(tmp_path):
    f = tmp_path / "bench.py"
    f.write_text("def worker():\n    from os import path\n    return path, parallelize_module\n")
    assert list(_unbound(f)) == ["worker (line 1): parallelize_module"]
