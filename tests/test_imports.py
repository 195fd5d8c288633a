"""The package's import graph stays a layered DAG, and importing it does nothing.

Every module under compiler/, ir/, passes/, runtime/ and shardprop/ is parsed with
``ast``; every import counts, at module level and inside functions (an import inside a
function hides a cycle but does not remove it), relative and absolute, and
``importlib.import_module("...")`` with a literal name.

What an edge is: ``import a.b.c`` / ``from a.b import c`` is an edge to the module
named (``a.b.c`` when ``c`` is a submodule, else ``a.b``). Python also runs the parent
packages' ``__init__`` first; that implicit step is not counted, so a package
``__init__`` that imports its own submodules is no cycle. A submodule that names its
package (``from ..passes.rules import rule_for``, where ``rules/__init__.py`` defines
or re-exports ``rule_for``) is an edge to that ``__init__``, and is counted.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# repository folder -> installed package (pyproject.toml's package-dir)
FOLDERS = {"shardprop": "shardprop", "compiler": "shardprop.compiler", "ir": "shardprop.ir",
           "passes": "shardprop.passes", "runtime": "shardprop.runtime"}
# a layer -> the layers it must not import
FORBIDDEN = {"shardprop.ir": ("shardprop.passes", "shardprop.compiler", "shardprop.runtime"),
             "shardprop.passes": ("shardprop.compiler", "shardprop.runtime")}


def discover(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package __init__)."""
    modules = {}
    for folder, package in FOLDERS.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = list(rel.parts)
            is_init = parts[-1] == "__init__"
            if is_init:
                parts = parts[:-1]
            if any(not p.isidentifier() for p in parts):
                continue
            modules[".".join([package] + parts)] = (path, is_init)
    return modules


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that ``name`` is, or lies in (``a.b.attr`` -> ``a.b``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _absolute(package: str, level: int, name: str | None) -> str:
    """A relative import's module: ``level`` dots from ``package`` (1: the package itself)."""
    base = package.split(".")
    if level > 1:
        base = base[:-(level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str, path: Path, is_init: bool, known: set[str]) -> set[tuple[str, int]]:
    """(imported module, line) for every import in the file, at any depth."""
    package = module if is_init else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    found = set()

    def add(name: str | None, line: int):
        target = _resolve(name, known) if name else None
        if target is not None and target != module:
            found.add((target, line))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            full = _absolute(package, node.level, node.module) if node.level else node.module
            for alias in node.names:
                sub = f"{full}.{alias.name}"
                add(sub if sub in known else full, node.lineno)
        elif isinstance(node, ast.Call):
            f = node.func
            named = (isinstance(f, ast.Attribute) and f.attr == "import_module") or \
                    (isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))
            if named and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                name = node.args[0].value
                if name.startswith("."):
                    bare = name.lstrip(".")
                    name = _absolute(package, len(name) - len(bare), bare or None)
                add(name, node.lineno)
    return found


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}."""
    modules = discover(root)
    known = set(modules)
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for m, (path, is_init) in modules.items():
        for target, line in sorted(imports_of(m, path, is_init, known)):
            graph[m].setdefault(target, line)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module, sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
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
                    out.append(sorted(comp))
    return sorted(out)


def _short(m: str, graph=None) -> str:
    """The module's file, as the repository names it (a package: its ``__init__``)."""
    path = m.removeprefix("shardprop.").replace(".", "/")
    if m == "shardprop":
        path = "shardprop"
    if graph is not None and any(o.startswith(m + ".") for o in graph):
        path += "/__init__"
    return path


def describe_cycles(graph, components) -> str:
    """Each component with the edges inside it (file:line), so a failure says what to cut."""
    lines = []
    for comp in components:
        inside = set(comp)
        lines.append("cycle: " + ", ".join(_short(m, graph) for m in comp))
        for m in comp:
            for t, line in sorted(graph[m].items()):
                if t in inside:
                    lines.append(f"    {_short(m, graph)}.py:{line} -> {_short(t, graph)}")
    return "\n".join(lines)


def layering_violations(graph) -> list[str]:
    bad = []
    for m, targets in sorted(graph.items()):
        for layer, banned in FORBIDDEN.items():
            if m == layer or m.startswith(layer + "."):
                for t, line in sorted(targets.items()):
                    if any(t == b or t.startswith(b + ".") for b in banned):
                        bad.append(f"{_short(m, graph)}.py:{line} imports {_short(t, graph)}")
    return bad


def test_the_graph_sees_imports_inside_functions():
    # the parser itself: a function-local import is an edge (the cycles hid behind them)
    graph = import_graph()
    assert len(graph) > 80
    assert "shardprop.compiler.api" in graph["shardprop.compiler"]
    edges = sum(len(t) for t in graph.values())
    assert edges > 200, edges


def test_no_import_cycles():
    graph = import_graph()
    components = strongly_connected(graph)
    assert not components, "\n" + describe_cycles(graph, components)


def test_layers_import_only_downwards():
    bad = layering_violations(import_graph())
    assert not bad, "\n".join(bad)


def test_a_cycle_and_a_layering_violation_are_found(tmp_path):
    # the checks themselves, on a tiny tree: a cycle through a function-local import,
    # and ir importing passes
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("from . import *\n")
    (tmp_path / "compiler" / "a.py").write_text("def f():\n    from .b import g\n")
    (tmp_path / "compiler" / "b.py").write_text("import importlib\nimportlib.import_module('shardprop.compiler.a')\n")
    (tmp_path / "ir" / "x.py").write_text("from ..passes import y\n")
    (tmp_path / "passes" / "y.py").write_text("")
    graph = import_graph(tmp_path)
    assert strongly_connected(graph) == [["shardprop.compiler.a", "shardprop.compiler.b"]]
    assert layering_violations(graph) == ["ir/x.py:1 imports passes/y"]


_NO_JOIN = textwrap.dedent("""
    import jax
    from jax._src import distributed
    calls = []
    jax.distributed.initialize = lambda *a, **k: calls.append((a, k))
    import shardprop
    import shardprop.ps, shardprop.runtime.launch, shardprop.compiler.cli
    assert not calls, calls
    assert distributed.global_state.client is None
    print("ok")
""")


@pytest.mark.multiprocess
def test_importing_shardprop_does_not_join_a_run():
    # a launcher's environment (and a cluster's): importing must not join jax.distributed
    env = dict(os.environ, SHARDPROP_COORDINATOR="127.0.0.1:1", SHARDPROP_NUM_PROCESSES="2",
               SHARDPROP_PROCESS_ID="1", SHARDPROP_INIT_TIMEOUT="1", OMPI_COMM_WORLD_SIZE="2")
    r = subprocess.run([sys.executable, "-c", _NO_JOIN], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_init_distributed_outside_a_run_does_nothing():
    import pytest

    import shardprop as sp
    from shardprop.runtime import distributed
    if distributed.in_multiprocess_environment():
        pytest.skip("this test process was started as one of several")
    assert sp.init_distributed is distributed.initialize
    assert sp.init_distributed() is False and sp.init_distributed() is False


_LATE_JOIN = textwrap.dedent("""
    import jax
    import shardprop as sp
    jax.devices()   # before joining: jax now sees this process's devices only
    try:
        sp.parallelize(lambda x: x, mesh=1)
    except RuntimeError as e:
        print("refused:", e)
""")


@pytest.mark.multiprocess
def test_joining_after_jax_looked_at_devices_says_what_to_do():
    env = dict(os.environ, SHARDPROP_COORDINATOR="127.0.0.1:1", SHARDPROP_NUM_PROCESSES="2",
               SHARDPROP_PROCESS_ID="1", SHARDPROP_INIT_TIMEOUT="1")
    r = subprocess.run([sys.executable, "-c", _LATE_JOIN], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused:" in r.stdout and "sp.init_distributed()" in r.stdout, r.stdout


# Module state: what a long-lived process that retraces keeps.

def _region_net():
    import jax.numpy as jnp
    import numpy as np

    import shardprop as sp

    def net(x, w):
        return jnp.tanh(sp.shard(jnp.matmul, ((2, 4), (4, 1)))(x, w))
    return net, np.ones((8, 16), np.float32), np.ones((16, 8), np.float32)


def test_no_unbounded_function_caches():
    # functools.cache / lru_cache(maxsize=None) keep every argument ever seen: in a
    # long-lived process that retraces, a leak. Give each cache a size.
    bad = []
    for m, (path, _) in sorted(discover().items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for d in node.decorator_list:
                name = ast.unparse(d.func if isinstance(d, ast.Call) else d)
                unbounded = name in ("cache", "functools.cache") or (
                    isinstance(d, ast.Call) and name in ("lru_cache", "functools.lru_cache")
                    and any(isinstance(a, ast.Constant) and a.value is None
                            for a in list(d.args[:1]) + [k.value for k in d.keywords if k.arg == "maxsize"]))
                if unbounded:
                    bad.append(f"{path.relative_to(ROOT)}:{d.lineno} {node.name}")
    assert not bad, "\n".join(bad)


def _live_regions() -> int:
    """Region objects alive, whatever table (or none) holds them."""
    import gc
    gc.collect()
    return sum(1 for o in gc.get_objects()
               if type(o).__name__ == "Region" and type(o).__module__.startswith("shardprop.compiler"))


@pytest.mark.slow
def test_retracing_does_not_grow_the_region_table():
    # A region lives while something holds its marks: a Graph, a jaxpr, or jax's own
    # caches (bounded LRUs: its abstract-eval cache keeps a primitive's params, the
    # marks' region ids among them, for its last 2048 calls). Nothing of shardprop's
    # keeps one: once jax's caches let go, no retrace has left a region behind.
    import jax

    import shardprop as sp
    from shardprop.compiler.region_registry import REGIONS
    from shardprop.compiler.trace import trace
    from shardprop.ir.mesh import Mesh

    before = _live_regions()
    for _ in range(300):   # a new function each time (jax would reuse the trace of the same one): a new region
        net, x, w = _region_net()
        graph, _, _ = trace(net, (x, w), {}, Mesh(("d0", "d1", "d2"), (2, 2, 2)))
        assert len(graph.regions) == 1
    for rows in (8, 16, 32):   # parallelize: a trace per input shape, dropped with the function
        f = sp.parallelize(net, mesh=8)
        f.plan(x.repeat(rows // 8, 0), w)
    del graph, f, net
    assert _live_regions() <= before + 303
    jax.clear_caches()
    assert _live_regions() <= before, _live_regions() - before
    assert len(REGIONS) <= before, len(REGIONS)


def test_a_region_lives_as_long_as_a_cached_trace_holds_its_marks():
    # jax caches a jitted function's jaxpr: its marks (and region) come back in later traces
    import jax

    from shardprop.compiler.trace import trace
    from shardprop.ir.mesh import Mesh

    inner, x, w = _region_net()
    jitted = jax.jit(inner)

    def net(x, w):
        return jitted(x, w) + 1.0
    mesh = Mesh(("d0", "d1", "d2"), (2, 2, 2))
    first, _, _ = trace(net, (x, w), {}, mesh)
    ids = set(first.regions)
    del first
    _live_regions()   # (a full collection)
    again, _, _ = trace(net, (x, w), {}, mesh)
    assert set(again.regions) == ids   # the cached jaxpr's marks: the same region, still known
    assert [r.in_strategy for r in again.regions.values()] == [(("splits", (2, 4)), ("splits", (4, 1)))]


if __name__ == "__main__":
    g = import_graph()
    print(describe_cycles(g, strongly_connected(g)) or "no cycles")
    print("\n".join(layering_violations(g)) or "no layering violations")
