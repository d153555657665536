"""The floor plan, checked: no import cycle, no late import of the package's own modules, no
module-level ``__getattr__`` outside a package's ``__init__``, folders of at most 15 modules,
and a core that never imports torch or tensordict."""

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# adapters/ is installed as functional_rb.adapters
TREES = (("functional_rb", "functional_rb"), ("adapters", "functional_rb.adapters"))
MAX_MODULES_PER_FOLDER = 15
# Imports inside functions are for optional dependencies only: each entry names the module
# holding such an import, the module it imports, and the optional package that import needs.
OPTIONAL = {
    ("functional_rb.testing", "functional_rb.testing.machine"): "hypothesis",
}


def _modules():
    out = {}
    for folder, package in TREES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _absolute(node, module, is_package):
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node, module, is_package):
    """The package's own modules an import statement loads (not their parent packages)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = _absolute(node, module, is_package)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    return {n for n in names if n in MODULES}


def _imports(module):
    """(module-level imports, imports inside functions) of the package's own modules."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    top, late = set(), set()

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (late if in_function else top).update(_targets(child, module, is_package))
            visit(
                child,
                in_function
                or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
            )

    visit(tree, False)
    return top - {module}, late - {module}, tree


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles(edges):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in edges:
        if v not in index:
            connect(v)
    return out


def test_no_import_cycle():
    cycles = _cycles({m: top for m, (top, _, _) in GRAPH.items()})
    assert not cycles, f"import cycles among module-level imports: {cycles}"


def _floor(module):
    """A core module's floor: its folder (``functional_rb.samplers``), or the module itself
    when it sits directly in the package (``functional_rb.buffer``); None for the adapters."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] == "adapters":
        return None
    return ".".join(parts[:2])


def test_no_two_floors_import_each_other():
    # the drawing of the house (docs/design.md): folders and top-level modules import
    # downwards only, so no cycle at that level either (a module-level cycle-free graph can
    # still tie two folders together, as _internal and checkpoint once were)
    edges: dict = {}
    for module, (top, late, _) in GRAPH.items():
        here = _floor(module)
        for target in top | late:
            there = _floor(target)
            if here and there and here != there:
                edges.setdefault(here, set()).add(there)
                edges.setdefault(there, set())
    cycles = _cycles(edges)
    assert not cycles, f"floors that import each other (directly or around a loop): {cycles}"


def test_no_late_import_of_own_modules():
    late = sorted(
        (m, t) for m, (_, imports, _) in GRAPH.items() for t in imports if (m, t) not in OPTIONAL
    )
    assert not late, (
        "imports of the package's own modules inside functions (allowed only "
        f"for an optional dependency, listed in OPTIONAL): {late}"
    )


def test_module_getattr_only_in_package_inits():
    found = [
        m
        for m, (_, _, tree) in GRAPH.items()
        if MODULES[m].name != "__init__.py"
        and any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)
    ]
    assert not found, f"module-level __getattr__ outside a package __init__: {found}"


def test_folders_stay_small():
    crowded = {}
    for folder, _ in TREES:
        for directory, _, files in os.walk(ROOT / folder):
            count = sum(f.endswith(".py") and f != "__init__.py" for f in files)
            if count > MAX_MODULES_PER_FOLDER:
                crowded[os.path.relpath(directory, ROOT)] = count
    assert not crowded, f"folders with more than {MAX_MODULES_PER_FOLDER} modules: {crowded}"


def test_core_never_imports_torch():
    # functional_rb.sb3 is a drop-in over Stable-Baselines3, which is built on torch
    offenders = []
    for module, path in MODULES.items():
        if module.startswith(("functional_rb.adapters", "functional_rb.sb3")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                (module, n) for n in names if n.split(".")[0] in ("torch", "tensordict", "torchrl")
            ]
    assert not offenders, f"the core imports torch: {offenders}"


def test_the_check_sees_a_cycle():
    # the checker itself can fail: a made-up two-module loop is reported
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def test_every_stable_name_module_is_listed_for_loading():
    # functional_rb imports its modules on first use; a checkpoint loader imports these to find
    # the classes a file names, so a module registering a stable name must be among them
    from functional_rb._internal.names import DEFINED_IN

    # (functional_rb.flashbax's records register theirs through @record: _records.py)
    registering = sorted(
        m
        for m, p in MODULES.items()
        if not m.startswith("functional_rb.adapters")
        and re.search(r"^@stable\(|^@record(\(sort_fields=False\))?$", p.read_text(), re.M)
    )
    assert registering == sorted(DEFINED_IN)


def test_importing_the_adapters_imports_no_jax():
    # the adapters' torch paths never run JAX: importing them must not pay its ~0.6 s, nor
    # must a traceback (inspect.stack() reads every module's __file__ in sys.modules)
    import subprocess
    import sys

    code = (
        "import sys, inspect, functional_rb.adapters as A, functional_rb as frb; "
        "rb = A.ReplayBuffer(storage=A.LazyTensorStorage(10), batch_size=2); "
        "import torch; rb.extend(torch.arange(6)); rb.sample(); inspect.stack(); "
        "[getattr(m, '__file__', None) for m in list(sys.modules.values())]; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "FRB_COMPILATION_CACHE": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout[-2000:]


_EACH_FIRST = r"""
import importlib, pkgutil, sys
import functional_rb
names = [m.name for m in pkgutil.walk_packages(functional_rb.__path__, "functional_rb.")
         if not m.name.startswith(("functional_rb.adapters", "functional_rb.testing"))]
failed = []
for name in names:
    for loaded in [k for k in sys.modules if k.split(".")[0] == "functional_rb"]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {e!r}")
print(len(names)); print("\n".join(failed))
"""


def test_every_core_module_imports_first():
    # the static check above cannot see cycles through a package's __init__ (run whenever one
    # of its modules is imported): import each core module as a process's first
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _EACH_FIRST], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    count, *failed = out.stdout.strip().split("\n")
    assert int(count) > 40 and not [f for f in failed if f], "\n".join(failed)


def test_lazy_exports_are_their_type_checking_imports():
    # a package that imports on first use names its exports once, in the TYPE_CHECKING imports
    # that type checkers and the API docs read; at run time each name must be the object that
    # import statement gives, and no second table of the same names may come back
    import importlib

    checked = 0
    for module, path in MODULES.items():
        source = path.read_text()
        if "lazy_exports_from_type_checking(__name__)" not in source:
            continue
        assert "_EXPORTS" not in source, f"{module} names its exports twice"
        pkg = importlib.import_module(module)
        lazy = {name: getattr(pkg, name) for name in pkg.__all__}  # before the imports below
        guarded = {}
        for node in ast.parse(source).body:
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                for imp in node.body:
                    for alias in imp.names:
                        namespace = {}
                        exec(f"from {imp.module} import {alias.name}", namespace)
                        guarded[alias.asname or alias.name] = namespace[alias.name]
        assert guarded and set(lazy) == set(guarded), module
        assert set(guarded) <= set(dir(pkg)), module
        wrong = [n for n, obj in guarded.items() if lazy[n] is not obj]
        assert not wrong, f"{module}: names that are not their TYPE_CHECKING import: {wrong}"
        checked += 1
    assert checked >= 3
