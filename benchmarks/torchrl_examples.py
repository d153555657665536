"""TorchRL's replay-buffer examples and tutorial, run as written and with only their imports
changed to ``functional_rb.adapters``; prints, per script, whether both ran and whether their
outputs (stdout) are the same.

Not part of CI (it needs a checkout of pytorch/rl: ``examples/replay-buffers`` and
``tutorials/sphinx-tutorials/rb_tutorial.py``)::

    python benchmarks/torchrl_examples.py --rl /path/to/rl [--out benchmarks/results/examples.json]

The imports are changed as a TorchRL user would change them: in every ``from torchrl.data...
import a, b`` the names ``functional_rb.adapters`` exports are imported from it instead; the
rest (environments, collectors, modules) stays TorchRL's.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = ["examples/replay-buffers/*.py", "tutorials/sphinx-tutorials/rb_tutorial.py"]


def patch_imports(source: str, ours: set) -> str:
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchrl.data"):
            mine = [a for a in node.names if a.name in ours]
            if not mine:
                continue
            rest = [a for a in node.names if a.name not in ours]
            indent = lines[node.lineno - 1][: node.col_offset]
            text = (
                indent
                + "from functional_rb.adapters import "
                + ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in mine)
                + "\n"
            )
            if rest:
                text += (
                    indent
                    + f"from {node.module} import "
                    + ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in rest)
                    + "\n"
                )
            edits.append((node.lineno - 1, node.end_lineno, text))
    for start, end, text in sorted(edits, reverse=True):
        lines[start:end] = [text]
    return "".join(lines)


def run(path: Path, cwd: Path, timeout: int) -> dict:
    env = dict(os.environ, PYTHONHASHSEED="0", JAX_PLATFORMS="cpu")
    t0 = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, str(path)],
            cwd=cwd,
            env=env,
            timeout=timeout,
            capture_output=True,
            text=True,
        )
        rc, stdout, stderr = out.returncode, out.stdout, out.stderr
    except subprocess.TimeoutExpired:
        rc, stdout, stderr = "timeout", "", ""
    return {
        "rc": rc,
        "stdout": stdout,
        "stderr_tail": stderr[-2000:],
        "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rl", required=True, type=Path, help="a checkout of pytorch/rl")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/torchrl_examples.json"))
    args = p.parse_args(argv)
    import functional_rb.adapters as A

    ours = set(A.__all__)
    report = {}
    with tempfile.TemporaryDirectory(prefix="torchrl_examples_") as tmp:
        for pattern in SCRIPTS:
            for script in sorted(args.rl.glob(pattern)):
                patched = Path(tmp) / script.name
                patched.write_text(patch_imports(script.read_text(), ours))
                theirs = run(script, Path(tmp), args.timeout)
                mine = run(patched, Path(tmp), args.timeout)
                same = theirs["stdout"] == mine["stdout"]
                report[script.name] = {"torchrl": theirs, "frb": mine, "same_stdout": same}
                print(
                    f"{script.name:45s} torchrl rc={theirs['rc']!s:7s} frb rc={mine['rc']!s:7s}"
                    f" same stdout={same}"
                )
                if mine["rc"] != 0:
                    print("   frb:", mine["stderr_tail"].strip().splitlines()[-1:] or "")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
