"""The docs' example of testing a sampler of your own (functional_rb.testing, the page
docs/testing.md) runs as printed, in under 25 lines, so it cannot drift from the library."""

import pathlib
import re

PAGE = pathlib.Path(__file__).resolve().parents[3] / "docs" / "testing.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 1
    return blocks[0]


def test_docs_custom_sampler_example_runs(capsys):
    code = _example()
    assert len(code.strip().splitlines()) < 25
    exec(compile(code, "docs/testing.md", "exec"), {"__name__": "readme_example"})
    assert capsys.readouterr().out.splitlines()[-1] == "RecentSampler passed"


def test_docs_example_fails_on_a_broken_sampler():
    """The example's check can fail: with the newest item off by one (the next slot to write,
    empty until the ring is full) check_sampler rejects it (the machine's own seeded bugs are
    in tests/core/testing/test_testing_machine.py)."""
    code = _example().replace("(ctx.cursor - 1 - age)", "(ctx.cursor - age)")
    assert code != _example()
    try:
        exec(compile(code.split("@settings")[0], "docs/testing.md", "exec"), {})
    except AssertionError as e:
        assert 'rule "drawn items are stored" is broken' in str(e)
    else:
        raise AssertionError("check_sampler accepted a sampler that draws empty slots")
