"""examples/actor_learner.py: actor threads and a learner thread on one buffer with a
RateLimiter; whatever the threads' relative speed, the error stays in the limiter's window and
the ratio of samples to inserts approaches samples_per_insert."""

import importlib.util
import pathlib
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "actor_learner.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("_example_actor_learner", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("actors", [1, 3])
def test_ratio_held_within_the_error_buffer(example, actors):
    r = example.run(actors=actors, updates=80, samples_per_insert=8.0, error_buffer=256.0)
    assert r["samples"] == 80 * example.BATCH
    assert r["min_diff"] <= r["error_min"] and r["error_max"] <= r["max_diff"]
    # the window bounds the drift: |inserts * 8 - samples| <= 256 + 256 * 8 (its centre)
    assert abs(r["inserts"] * 8 - r["samples"]) <= r["max_diff"]
    assert r["ratio"] == pytest.approx(8.0, rel=0.5)


def test_main_prints_the_ratio(example, capsys):
    assert example.main(["--actors", "2", "--updates", "40"]) == 0
    text = capsys.readouterr().out
    assert "samples per insert:" in text and "the ratio held within the error buffer" in text
