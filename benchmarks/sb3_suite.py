"""Stable-Baselines3's own tests of its replay buffers, run with SB3's replay-buffer classes
replaced by ``functional_rb.sb3``'s (``ReplayBuffer``, ``DictReplayBuffer``,
``NStepReplayBuffer``, ``HerReplayBuffer``) everywhere SB3 and its tests look them up, the way
SB3's CI runs them (its ``[tool.pytest.ini_options]``, ``-m "not expensive"``). Reports how
many cases pass with ours, and for each that fails, whether it fails with SB3's classes too.

The tests are read at run time from SB3's source distribution of the installed version
(``stable_baselines3-<version>.tar.gz`` ships ``tests/``; the wheel does not), downloaded once
with ``pip download --no-deps --no-binary :all:`` into ``$FRB_SB3_SDIST`` (a directory, or the
``.tar.gz`` itself) or else ``~/.cache/functional_rb/sb3_suite/``; nothing of SB3 is kept in
this repository::

    python benchmarks/sb3_suite.py [--sides classify|both|frb|sb3] [-n WORKERS]
        [--files test_her.py test_save_load.py::test_warn_buffer ...] [-k EXPR]
        [--json benchmarks/results/sb3_suite.json]

``--sides classify`` (the default) runs every case with ours, then only the cases ours fails
with SB3's own classes, to tell ours' failures from SB3's own; ``both`` runs every case on each
side; ``frb`` / ``sb3`` one side only. With ``-n``, each worker's torch threads compete for the
cores (on 2 cores under load, ``-n 2`` ran slower than ``-n 0``): set ``OMP_NUM_THREADS=1``.
Exit status: 1 when a case that passes with SB3's classes fails with ours (with one side only:
when any case fails), else 0.

The set (:data:`SELECTION`; ``--files`` picks from it, and a file outside it runs whole): 206
cases with SB3 2.9.2, of which SB3 itself skips 9 here (4 CUDA, 3 gSDE with other algorithms
than SAC, 2 SAC without squashed output):

- ``test_buffers.py``, ``test_her.py``, ``test_n_step_replay.py``: whole; the replay buffers'
  own tests (the rollout-buffer cases of ``test_buffers.py`` run too: they keep SB3's classes
  and pass on both sides).
- ``test_save_load.py``: ``test_save_load_replay_buffer``, ``test_warn_buffer`` (the
  truncation warning of ``optimize_memory_usage``), ``test_no_resource_warning`` (saves and
  loads a replay buffer to paths and open files); the file's other tests save models, whose
  archive leaves the replay buffer out.
- ``test_dict_env.py``: the cases of an off-policy algorithm (DQN, DDPG, SAC, TD3: a
  ``DictReplayBuffer``) of ``test_consistency``, ``test_dict_spaces``, ``test_multiprocessing``,
  ``test_dict_vec_framestack``, ``test_vec_normalize``; its other tests and cases use PPO and
  A2C (rollout buffers) or no model.
- The other files whose tests name a replay buffer (``grep -il replay_buffer tests/*.py``):
  ``test_vec_normalize.py::test_her_normalization`` and ``::test_offpolicy_normalization``
  (the buffer normalises what it samples); ``test_callbacks.py::test_eval_success_logging``
  (HER), ``::test_checkpoint_additional_info`` (``save_replay_buffer=True``) and the SAC cases
  of ``::test_callbacks_can_cancel_runs`` (``buffer_size=1``); the SAC cases of
  ``test_gae.py::test_infinite_horizon`` (``handle_timeout_termination``) and of
  ``test_sde.py::test_state_dependent_noise`` (reads ``model.replay_buffer.actions``).
- ``test_run.py::test_offpolicy_multi_env``, though it names no buffer: two environments
  writing one buffer, time limits, and ``gradient_steps=-1`` (as many updates as transitions).

Tests that need what this machine lacks (CUDA, tensorboard) are skipped by SB3's own
``pytest.skip`` / ``importorskip``, as in SB3's CI. SB3's test files import nothing from each
other and need no ``tests`` package.

How the classes are replaced: the run's root ``conftest.py`` loads this file as a plugin. With
``FRB_SB3_SIDE=frb`` it imports ``functional_rb.sb3`` first (its classes subclass SB3's, so they
must be created from SB3's originals before any is replaced), then, in every loaded
``stable_baselines3.*`` and ``sb3_contrib.*`` module whose attribute ``ReplayBuffer``
(``DictReplayBuffer``, ...) is SB3's class: a module that imported it
(``common.off_policy_algorithm``, ``her``, the package itself, the algorithms' modules) gets
ours in its globals, so that SB3's defaults build ours and its checks
(``issubclass(self.replay_buffer_class, HerReplayBuffer)``) compare with ours; the two that
define them (``common.buffers``, ``her.her_replay_buffer``) keep SB3's classes in their globals,
whose methods call ``super(ReplayBuffer, self)``, and show ours to every reader from outside
(:class:`_DefiningModule`). The test modules import after that, so ``from
stable_baselines3.common.buffers import ReplayBuffer`` binds ours; collection fails if a test
module still holds one of SB3's. Rollout buffers stay SB3's, and so does a name that
``functional_rb.sb3`` binds to SB3's own class (the report lists it). Our classes' parameter
ids are SB3's class names, so a case has one id on both sides.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import xml.etree.ElementTree as ET
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `python benchmarks/sb3_suite.py` from the checkout
    sys.path.append(str(_ROOT))

from benchmarks._pytest_runner import run_pytest as _run_pytest

BUFFER_NAMES = ("ReplayBuffer", "DictReplayBuffer", "NStepReplayBuffer", "HerReplayBuffer")
PATCHED_PACKAGES = ("stable_baselines3", "sb3_contrib")

ALL = "all"  # every case of the test
OFF_POLICY = "off-policy"  # the cases with an off-policy algorithm class among their parameters

# file -> None (the whole file) or {test function: which of its cases}; why each: the docstring
SELECTION: dict = {
    "test_buffers.py": None,
    "test_her.py": None,
    "test_n_step_replay.py": None,
    "test_save_load.py": {
        "test_save_load_replay_buffer": ALL,
        "test_warn_buffer": ALL,
        "test_no_resource_warning": ALL,
    },
    "test_dict_env.py": {
        "test_consistency": OFF_POLICY,
        "test_dict_spaces": OFF_POLICY,
        "test_multiprocessing": OFF_POLICY,
        "test_dict_vec_framestack": OFF_POLICY,
        "test_vec_normalize": OFF_POLICY,
    },
    "test_vec_normalize.py": {"test_her_normalization": ALL, "test_offpolicy_normalization": ALL},
    "test_callbacks.py": {
        "test_eval_success_logging": ALL,
        "test_checkpoint_additional_info": ALL,
        "test_callbacks_can_cancel_runs": OFF_POLICY,
    },
    "test_gae.py": {"test_infinite_horizon": OFF_POLICY},
    "test_sde.py": {"test_state_dependent_noise": OFF_POLICY},
    "test_run.py": {"test_offpolicy_multi_env": ALL},
}

SIDE_ENV = "FRB_SB3_SIDE"  # frb: ours replace SB3's; sb3 (or unset): SB3's own classes
KEEP_ENV = "FRB_SB3_KEEP"  # a file of case ids, one a line: run only those (classify's rerun)
SDIST_ENV = "FRB_SB3_SDIST"
DEFAULT_CACHE = Path("~/.cache/functional_rb/sb3_suite")

_CONFTEST = '''"""Written by functional_rb's benchmarks/sb3_suite.py: loads that file as this run's
pytest plugin (SB3's replay-buffer classes replaced by ours when {side_env}=frb; the set of
cases)."""

import importlib.util
import sys

_spec = importlib.util.spec_from_file_location("frb_sb3_suite", {path!r})
_suite = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _suite
_spec.loader.exec_module(_suite)
_suite.start_side()

pytest_collection_modifyitems = _suite.pytest_collection_modifyitems
pytest_make_parametrize_id = _suite.pytest_make_parametrize_id
'''


# -- the plugin: runs inside the pytest process, loaded by the conftest above --------------

# SB3's class -> ours, once start_side has replaced SB3's classes (empty on SB3's side)
_OURS: dict = {}


class _DefiningModule(types.ModuleType):
    """The class given on our side to the SB3 modules that define the replay buffers
    (``common.buffers``, ``her.her_replay_buffer``): a read from outside
    (``buffers.ReplayBuffer``, ``from ... import ReplayBuffer``) gets ours, while the module's
    own code, which reads its globals directly, keeps SB3's classes. It must: SB3's methods
    name their class in ``super(ReplayBuffer, self)``, which with ours there would lead from
    our subclass back into SB3's method (endless recursion) or reject an SB3 class that is
    not ours (TypeError)."""

    def __getattribute__(self, name):
        value = super().__getattribute__(name)
        return _OURS.get(value, value) if name in BUFFER_NAMES else value


def _sb3_class(value) -> bool:
    return isinstance(value, type) and value in _OURS


def replace_buffers() -> dict:
    """Replace SB3's four replay-buffer classes by ``functional_rb.sb3``'s in every loaded
    ``stable_baselines3`` / ``sb3_contrib`` module; returns ``{SB3's class: ours}`` (without
    the names that ``functional_rb.sb3`` binds to SB3's own class).

    Raises ``ImportError`` when ``functional_rb.sb3`` cannot be imported, ``TypeError`` when
    one of ours does not subclass SB3's class of its name."""
    # importing a submodule runs stable_baselines3/__init__.py, which loads the algorithms,
    # off_policy_algorithm and her; ours is imported before anything is replaced, since its
    # classes are built on SB3's originals
    import stable_baselines3.common.buffers as sb3_buffers
    import stable_baselines3.her.her_replay_buffer as sb3_her

    import functional_rb.sb3 as ours

    for name in BUFFER_NAMES:
        original = getattr(sb3_her if name == "HerReplayBuffer" else sb3_buffers, name)
        mine = getattr(ours, name)
        if not (isinstance(mine, type) and issubclass(mine, original)):
            raise TypeError(
                f"functional_rb.sb3.{name} must subclass {original.__module__}.{name} (so that "
                f"SB3's isinstance checks pass); got {mine!r}"
            )
        if mine is not original:  # else ours re-exports SB3's class: nothing to replace
            _OURS[original] = mine
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith(PATCHED_PACKAGES):
            continue
        for name in BUFFER_NAMES:
            # by identity: a module's other attribute of that name is not SB3's class
            original = module.__dict__.get(name)
            if not _sb3_class(original):
                continue
            if original.__module__ == module.__name__:
                module.__class__ = _DefiningModule
            else:
                setattr(module, name, _OURS[original])
    return dict(_OURS)


def start_side() -> None:
    """Set up this pytest process for the side named by ``$FRB_SB3_SIDE``."""
    import pytest

    if os.environ.get(SIDE_ENV, "sb3") != "frb":
        return
    try:
        replace_buffers()
    except ImportError as exc:
        raise pytest.UsageError(f"functional_rb.sb3 is not importable: {exc!r}") from exc


def _wanted(item) -> bool:
    """Whether a collected case is in :data:`SELECTION` (a file outside it runs whole)."""
    file = item.path.name
    if file not in SELECTION or SELECTION[file] is None:
        return True
    rule = SELECTION[file].get(item.originalname)
    if rule != OFF_POLICY:
        return rule == ALL
    from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm

    params = getattr(item, "callspec", None)
    values = params.params.values() if params else ()
    return any(isinstance(v, type) and issubclass(v, OffPolicyAlgorithm) for v in values)


def _check_test_modules(items) -> None:
    """On our side, fail when a test module still holds one of SB3's replaced classes (it
    was imported before the replacement)."""
    import pytest

    for module in {item.module for item in items if getattr(item, "module", None)}:
        stale = [n for n in BUFFER_NAMES if _sb3_class(module.__dict__.get(n))]
        if stale:
            raise pytest.UsageError(f"{module.__name__} holds SB3's {stale}, not ours")


def pytest_collection_modifyitems(config, items):
    keep_file = os.environ.get(KEEP_ENV)
    keep = set(Path(keep_file).read_text().split("\n")) if keep_file else None
    chosen, dropped = [], []
    for item in items:
        ok = _wanted(item) and (keep is None or case_id(item.nodeid) in keep)
        (chosen if ok else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = chosen
    if _OURS:
        _check_test_modules(items)


def pytest_make_parametrize_id(config, val, argname):
    # our classes get SB3's names as ids, so a case has the same id on both sides
    if isinstance(val, type) and val in _OURS.values():
        return next(sb3.__name__ for sb3, mine in _OURS.items() if mine is val)
    return None


# -- the runner ------------------------------------------------------------------------------


_STATUSES = ("passed", "failed", "skipped")


def case_id(nodeid: str) -> str:
    """A case's id relative to SB3's ``tests/``: ``test_her.py::test_her[True-SAC]``."""
    return nodeid.removeprefix("tests/")


def sdist(version: str) -> Path:
    """SB3's source distribution of ``version``: the cached copy, else downloaded with pip."""
    where = Path(os.environ.get(SDIST_ENV) or DEFAULT_CACHE).expanduser()
    if where.is_file():
        return where
    path = where / f"stable_baselines3-{version}.tar.gz"
    if path.exists():
        return path
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    cmd += [f"stable-baselines3=={version}", "-d", str(where)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode or not path.exists():
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-8:])
        raise SystemExit(
            f"could not download SB3's source distribution ({' '.join(cmd)}):\n{tail}\n"
            f"Put stable_baselines3-{version}.tar.gz in {where} or set ${SDIST_ENV} to it."
        )
    return path


def prepare(dest: Path) -> None:
    """Extract SB3's ``tests/`` and ``pyproject.toml`` (its pytest settings) from the
    source distribution into ``dest``, and write the plugin's ``conftest.py`` there."""
    version = importlib.metadata.version("stable_baselines3")
    prefix = f"stable_baselines3-{version}/"
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist(version)) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name.removeprefix(prefix)
            if m.name.startswith(prefix) and (rel == "pyproject.toml" or rel.startswith("tests/")):
                m.name = rel
                members.append(m)
        if not any(m.name.startswith("tests/") for m in members):
            raise SystemExit(f"{tar.name} holds no {prefix}tests/")
        tar.extractall(dest, members=members, filter="data")
    (dest / "conftest.py").write_text(
        _CONFTEST.format(path=str(Path(__file__).resolve()), side_env=SIDE_ENV)
    )


def targets(files) -> list:
    """pytest targets under ``tests/`` for ``--files`` (the whole set when none)."""
    return [f"tests/{f}" for f in (files or SELECTION)]


def run_side(where: Path, side: str, tests, *, k=None, workers=0, keep=None, timeout_s=None):
    """Run ``tests`` (from :func:`targets`) in ``where`` with ``side``'s classes (``keep``:
    only these case ids); returns (:func:`outcomes`, seconds)."""
    junit = where / f"{side}.xml"
    env = {**os.environ, SIDE_ENV: side, "PYTHONDONTWRITEBYTECODE": "1"}
    # SB3 makes a logger directory per learn(): under ``where``, not as /tmp/SB3-<time>
    env["SB3_LOGDIR"] = str(where / "sb3_logs")
    env.pop(KEEP_ENV, None)
    if keep is not None:
        (where / "keep.txt").write_text("\n".join(sorted(keep)))
        env[KEEP_ENV] = str(where / "keep.txt")
    seconds = _run_pytest(
        where,
        tests,
        junit=junit,
        env=env,
        k=k,
        # SB3's CI deselects "expensive"; --tb=short: a failure's last lines for the report
        extra_args=[
            "--rootdir",
            str(where),
            "-m",
            "not expensive",
            "--tb=short",
            *(["-n", str(workers)] if workers else ["-p", "no:xdist"]),
        ],
        timeout_s=timeout_s,
        require_report=True,
    )
    return outcomes(junit, where), seconds


def outcomes(junit: Path, root: Path) -> dict:
    """``{case id: (outcome, last lines of its error or skip reason, seconds)}`` from a JUnit XML
    report (an error in set-up or tear-down counts as a failure); paths under ``root``, the
    run's temporary directory, are written relative to it."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        status, lines = "passed", []
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = "skipped" if tag == "skipped" else "failed"
                text = (node.text or "").strip() or node.get("message") or ""
                text = text.replace(f"{root}/", "")
                lines = [ln for ln in text.splitlines() if ln.strip()][-6:]
                break
        seconds = float(case.get("time") or 0)
        result[case_id(f"{path}::{case.get('name')}")] = (status, lines, seconds)
    return result


def report(frb: dict | None, sb3: dict | None, seconds: dict, rerun: bool = False) -> dict:
    """The JSON report: per case its outcome on each side that ran it, the counts per side,
    and, when both sides ran, which of ours' failures fail with SB3's classes too.
    ``rerun``: ``sb3`` holds only ours' failures, rerun with SB3's classes (classify)."""
    cases = {}
    for side, results in (("frb", frb), ("sb3", sb3)):
        for case, (status, lines, took) in (results or {}).items():
            row = cases.setdefault(case, {})
            row[side] = status
            row[f"{side}_s"] = round(took, 2)
            if status != "passed" and lines:
                row[f"{side}_error"] = lines
    summary = {"cases": len(cases), "seconds": {s: round(t, 1) for s, t in seconds.items()}}
    for side, results in (("frb", frb), ("sb3", sb3)):
        if results is not None:
            counts = {st: sum(r[0] == st for r in results.values()) for st in _STATUSES}
            slowest = sorted(results.items(), key=lambda kv: -kv[1][2])[:5]
            counts["slowest_s"] = {c: round(r[2], 1) for c, r in slowest}
            summary["sb3_rerun" if side == "sb3" and rerun else side] = counts
    if frb is not None and sb3 is not None:
        failed = sorted(c for c, (st, *_) in frb.items() if st == "failed")
        summary["failed_with_sb3_too"] = [c for c in failed if cases[c].get("sb3") == "failed"]
        # the cases that count against ours: they pass with SB3's classes
        summary["unexpected_failures"] = [c for c in failed if cases[c].get("sb3") == "passed"]
        summary["pass_with_ours_only"] = sorted(
            c for c, r in cases.items() if r.get("sb3") == "failed" and r.get("frb") == "passed"
        )
    return {"summary": summary, "cases": dict(sorted(cases.items()))}


def ours_importable() -> str | None:
    """Why ``functional_rb.sb3`` cannot be imported, or None when it can."""
    try:
        import functional_rb.sb3  # noqa: F401
    except Exception as exc:  # any failure at import, not only a missing module
        return f"{type(exc).__name__}: {exc}"
    return None


def not_replaced() -> list:
    """The names that ``functional_rb.sb3`` binds to SB3's own class (nothing of ours runs in
    their place)."""
    import stable_baselines3.common.buffers as sb3_buffers
    import stable_baselines3.her.her_replay_buffer as sb3_her

    import functional_rb.sb3 as ours

    return [
        name
        for name in BUFFER_NAMES
        if getattr(ours, name, None) is getattr(sb3_her if "Her" in name else sb3_buffers, name)
    ]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sides",
        choices=("classify", "both", "frb", "sb3"),
        default="classify",
        help="classify: every case with ours, then ours' failures with SB3's classes; both: "
        "every case on each side; frb / sb3: one side only",
    )
    ap.add_argument(
        "--files",
        nargs="*",
        help="files or node ids relative to SB3's tests/ (default: the whole set)",
    )
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("-n", "--workers", type=int, default=0, help="pytest-xdist workers")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds, per side")
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sides != "sb3":
        why = ours_importable()
        if why:
            raise SystemExit(f"functional_rb.sb3 is not importable: {why}")
    tests, results, seconds = targets(args.files), {}, {}
    run_args = dict(k=args.k, workers=args.workers, timeout_s=args.timeout)
    with tempfile.TemporaryDirectory(prefix="sb3_suite_") as tmp:
        where = Path(tmp)
        prepare(where)
        first = {"classify": ["frb"], "both": ["sb3", "frb"]}.get(args.sides, [args.sides])
        for side in first:
            results[side], seconds[side] = run_side(where, side, tests, **run_args)
        if args.sides == "classify":
            failed = {c for c, (st, *_) in results["frb"].items() if st == "failed"}
            results["sb3"] = {}
            if failed:
                results["sb3"], seconds["sb3"] = run_side(
                    where, "sb3", tests, keep=failed, **run_args
                )
    out = report(results.get("frb"), results.get("sb3"), seconds, args.sides == "classify")
    if args.sides != "sb3" and not_replaced():
        out["summary"]["ours_is_sb3s_own_class"] = not_replaced()
    text = json.dumps(out, indent=1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(json.dumps(out["summary"], indent=1))
    summary = out["summary"]
    if "unexpected_failures" in summary:
        return 1 if summary["unexpected_failures"] else 0
    return 1 if any(summary.get(s, {}).get("failed") for s in ("frb", "sb3")) else 0


if __name__ == "__main__":
    sys.exit(main())
