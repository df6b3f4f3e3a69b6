"""The layer rules of ARCHITECTURE.md, read from the source with ``ast``.

* no import cycles between modules, counting every import (those inside functions
  too: a lazy import that closes a loop still ties the two layers together);
* ``commsim`` never imports ``runtime`` (runtime depends on commsim and torch), but
  for the command line: the commands that run the executor (execute, calibrate,
  record) import it inside the command, so the CLI still loads without torch;
* the simulator (``commsim.sim``) never imports the generators (``commsim.strategies``)
  or the models (``commsim.models``): it sees schedules and costs only;
* the IR (``commsim.ir``) imports nothing of commsim beyond itself and ``commsim.util``;
* ``commsim`` never imports torch at module level (a planner installs it without torch;
  torch is imported lazily where a torch module is walked).

Imports under ``if TYPE_CHECKING:`` are for type checkers only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for top in ("commsim", "runtime") for p in sorted((ROOT / top).rglob("*.py"))}


def _resolve(module: str, level: int, here: str, is_package: bool) -> str:
    if not level:
        return module
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import in ``name``'s source."""
    path = MODULES[name]
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            at_top = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, at_top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                mod = _resolve(child.module or "", child.level, name, path.name == "__init__.py")
                for a in child.names:  # `from pkg import module` imports the module
                    full = f"{mod}.{a.name}"
                    out.append((full if full in MODULES else mod, at_top))
            visit(child, at_top)

    visit(ast.parse(path.read_text(), str(path)), True)
    return out


GRAPH = {m: {i for i, _ in imports_of(m) if i in MODULES and i != m} for m in MODULES}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_graph_is_read():
    # a sanity floor, so that a broken walker cannot pass every rule below vacuously
    assert len(MODULES) > 40
    assert "commsim.ir.ops" in GRAPH["commsim.sim.engine"]
    assert "commsim.ir.schedule" in GRAPH["commsim.ir.serialize"]


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# the command line's modules that run the runtime (execute, calibrate, record)
RUNS_RUNTIME = ("commsim.cli.measure",)


def test_only_the_command_line_imports_runtime_and_only_inside_a_command():
    bad = sorted(f"{m} imports {i}" + (" at module level" if top else "") for m in MODULES if _within(m, "commsim")
                 for i, top in imports_of(m) if _within(i, "runtime")
                 and (top or not any(_within(m, f) for f in RUNS_RUNTIME)))
    assert bad == []


@pytest.mark.parametrize("importer, forbidden", [
    ("commsim.sim", "commsim.strategies"),
    ("commsim.sim", "commsim.models"),
    ("commsim.ir", "commsim.strategies"),
    ("commsim.ir", "commsim.models"),
    ("commsim.ir", "commsim.sim"),
    ("commsim.ir", "commsim.hardware"),
    ("commsim.ir", "commsim.report"),
    ("commsim.hardware", "commsim.sim"),
    ("commsim.hardware", "commsim.strategies"),
])
def test_layer_rule(importer, forbidden):
    bad = sorted(f"{m} imports {i}" for m in MODULES if _within(m, importer)
                 for i, _ in imports_of(m) if _within(i, forbidden))
    assert bad == []


def test_commsim_does_not_import_torch_at_module_level():
    bad = sorted(f"{m} imports {i}" for m in MODULES if _within(m, "commsim")
                 for i, top in imports_of(m) if top and _within(i, "torch"))
    assert bad == []
