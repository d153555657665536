"""benchmarks/flashbax_compat.py's ``prioritised_add`` (flashbax issue #62: ``add`` alone of
the prioritised trajectory buffer for several time lengths) cannot rot: a tiny run of both
sides writes one JSON row per length, and lengths the buffer cannot take are refused."""

import importlib.util
import json
import pathlib
import sys

import jax
import pytest

pytest.importorskip("flashbax")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    # by path: the checkout's benchmarks/ is not an installed package
    spec = importlib.util.spec_from_file_location(
        "frb_flashbax_compat", ROOT / "benchmarks" / "flashbax_compat.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


TINY = ["--quick", "--capacity", "256", "--envs", "2", "--calls", "2", "--rounds", "1"]


def test_prioritised_add_rows_in_the_json(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "add.json"
    argv = TINY + ["--buffers", "prioritised_add", "--add-lengths", "1", "4", "--out", str(out)]
    with jax.numpy_rank_promotion("allow"):  # flashbax's prioritised add broadcasts ranks
        assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["buffer"], r["mode"], r["unit"]) for r in rows] == [
        ("prioritised_add", "add T=1", "us/call"),
        ("prioritised_add", "add T=4", "us/call"),
    ]
    for row in rows:
        assert len(row["ratio"]["values"]) == len(row["loads"]) == 1
        assert row["flashbax"]["median"] > 0 and row["functional_rb"]["median"] > 0
    assert "| prioritised_add | add T=4 (us/call) |" in capsys.readouterr().out


def test_add_lengths_past_a_row_are_refused(capsys):
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.parse_args(TINY + ["--buffers", "prioritised_add", "--add-lengths", "1", "129"])
    assert "--add-lengths must lie in [1, 128]" in capsys.readouterr().err
