"""Every ``functional_rb`` name the README and the documentation pages mention exists.

A page that names ``functional_rb.adapters.boundaries.DEFAULT_DONE_KEYS`` or
``frb.checkpoint.save`` promises a module, class or function a reader can import. The test
collects each dotted name that starts with ``functional_rb.`` (or ``frb.``, the alias the pages
import it as) from README.md, examples/README.md, benchmarks/README.md and docs/**/*.md, and
resolves it: the longest prefix that imports as a module, then attributes. It also checks that
each repository path the pages give (``functional_rb/...`` or ``adapters/...``, ``tests/...``,
``benchmarks/...``, ``examples/...``) exists. A name whose module needs an optional dependency
that is not installed is skipped, not failed.
"""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "examples" / "README.md",
        ROOT / "benchmarks" / "README.md",
        *(ROOT / "docs").rglob("*.md"),
    ]
)

# a dotted name: functional_rb.x.y or frb.x.y (not preceded by a path separator or a dot,
# so "tests/functional_rb.py" or "self.frb.x" are not names)
_NAME = re.compile(r"(?<![\w./-])(functional_rb|frb)((?:\.[A-Za-z_]\w*)+)")
# a repository path: a known top folder, then path parts, ending in a file with an extension
_PATH = re.compile(
    r"(?<![\w./-])((?:functional_rb|adapters|tests|benchmarks|examples|docs)"
    r"(?:/[\w.-]+)+\.(?:py|md|txt|json|yml|toml))"
)


def _mentions(pattern, group=0, *, in_code_blocks=True):
    """``{mention: "page:line"}`` (its first place) of ``pattern``'s matches."""
    found = {}
    for page in PAGES:
        if not page.exists():
            continue
        fenced = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if fenced and not in_code_blocks:
                continue
            for m in pattern.finditer(line):
                found.setdefault(
                    m.group(group) if group else m.group(0), f"{page.relative_to(ROOT)}:{number}"
                )
    return found


NAMES = _mentions(_NAME)
# paths in shell blocks may be files a command writes (a benchmark's results): prose only
PATHS = _mentions(_PATH, 1, in_code_blocks=False)


def _resolve(name: str):
    """The object ``name`` names, or raise ``LookupError`` saying which part is missing."""
    parts = ["functional_rb"] + name.split(".")[1:]
    module, depth = None, 0
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("functional_rb"):
                pytest.skip(f"{name}: needs the optional dependency {e.name!r}")
            continue
        depth = i
        break
    obj = module
    for part in parts[depth:]:
        if not hasattr(obj, part):
            raise LookupError(f"{'.'.join(parts[:depth])} has no attribute {part!r}")
        obj, depth = getattr(obj, part), depth + 1
    return obj


def test_the_pages_name_functional_rb_things():
    assert len(NAMES) > 50 and len(PATHS) > 5  # the patterns still match the pages


@pytest.mark.parametrize("name", sorted(NAMES), ids=sorted(NAMES))
def test_every_named_module_class_and_function_exists(name):
    try:
        _resolve(name)
    except LookupError as e:
        pytest.fail(
            f"{NAMES[name]} names {name}, which does not exist ({e}). Fix the page, "
            "or the code it describes."
        )


@pytest.mark.parametrize("path", sorted(PATHS), ids=sorted(PATHS))
def test_every_named_repository_path_exists(path):
    assert (ROOT / path).exists(), (
        f"{PATHS[path]} names the file {path}, which does not "
        "exist. Fix the page, or the code it describes."
    )


def test_a_missing_name_is_caught():
    with pytest.raises(LookupError, match="no attribute 'NoSuchSampler'"):
        _resolve("frb.samplers.NoSuchSampler")
    with pytest.raises(LookupError, match="no attribute 'nothing_here'"):
        _resolve("functional_rb.adapters.boundaries.nothing_here")
    assert (
        _resolve("frb.checkpoint.save") is importlib.import_module("functional_rb.checkpoint").save
    )


# ------------------------------------------------------------------ the floor plan
DESIGN = ROOT / "docs" / "design.md"


def _floor_plan() -> dict:
    """``{folder: set of the .py files and subfolders its row names}`` of design.md's table."""
    text = DESIGN.read_text()
    table = text[text.index("## Floor plan") :]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `((?:functional_rb|adapters)/(?:[\w]+/)*)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`([\w]+\.py|[\w]+/)`", m.group(2)))
    return rows


def _folders():
    """Every package folder of the two trees (functional_rb/adapters is the link to
    adapters/, not a folder of its own; functional_rb/flashbax's sub-packages are its row's)."""
    out = {}
    for top in ("functional_rb", "adapters"):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            folder = init.parent.relative_to(ROOT).as_posix() + "/"
            if folder.startswith("functional_rb/adapters/") or "__pycache__" in folder:
                continue
            out[folder] = init.parent
    return out


def test_the_floor_plan_names_every_folder_and_only_folders_that_exist():
    plan, folders = _floor_plan(), _folders()
    # a folder has a row of its own, or its parent's row names it ("buffers/")
    missing = sorted(
        f
        for f in folders
        if f not in plan
        and not any(f == parent + sub for parent, names in plan.items() for sub in names)
    )
    ghost = sorted(set(plan) - set(folders))
    assert not missing, f"docs/design.md's floor plan leaves out the folders {missing}"
    assert not ghost, f"docs/design.md's floor plan names folders that do not exist: {ghost}"


def test_the_floor_plan_names_every_module_of_each_folder():
    for folder, names in _floor_plan().items():
        path = ROOT / folder
        modules = {p.name for p in path.glob("*.py") if p.name != "__init__.py"}
        subfolders = {
            p.name + "/"
            for p in path.iterdir()
            if (p / "__init__.py").exists()
            and f"{folder}{p.name}/" not in _floor_plan()
            and p.name != "adapters"
        }
        ghost = sorted(n for n in names if n not in modules | subfolders)
        assert not ghost, f"docs/design.md: {folder} names {ghost}, which it does not hold"
        missing = sorted((modules | subfolders) - names)
        assert not missing, f"docs/design.md: the row of {folder} leaves out {missing}"
