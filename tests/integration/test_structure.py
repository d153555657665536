"""The floor plan, checked: no import cycle, no late import of the package's own modules, no
module-level ``__getattr__`` outside a package's ``__init__``, folders of at most 15 modules,
and a core that never imports torch or tensordict."""
import ast
import os
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
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node, module, is_package):
    """The package's own modules an import statement loads (not their parent packages)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = _absolute(node, module, is_package)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                 for a in node.names]
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
            visit(child, in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
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


def test_no_late_import_of_own_modules():
    late = sorted((m, t) for m, (_, imports, _) in GRAPH.items() for t in imports
                  if (m, t) not in OPTIONAL)
    assert not late, ("imports of the package's own modules inside functions (allowed only "
                      f"for an optional dependency, listed in OPTIONAL): {late}")


def test_module_getattr_only_in_package_inits():
    found = [m for m, (_, _, tree) in GRAPH.items() if MODULES[m].name != "__init__.py"
             and any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
                     for n in tree.body)]
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
    offenders = []
    for module, path in MODULES.items():
        if module.startswith("functional_rb.adapters"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [(module, n) for n in names
                          if n.split(".")[0] in ("torch", "tensordict", "torchrl")]
    assert not offenders, f"the core imports torch: {offenders}"


def test_the_check_sees_a_cycle():
    # the checker itself can fail: a made-up two-module loop is reported
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
