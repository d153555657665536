"""The README's example of testing a sampler of your own (functional_rb.testing) runs as
printed, in under 25 lines, so it cannot drift from the library."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[3] / "README.md"
SECTION = "## Testing your own components (`functional_rb.testing`)"


def _example() -> str:
    text = README.read_text()
    assert text.index(SECTION) < text.index("## Features")
    return re.search(re.escape(SECTION) + r"\n.*?```python\n(.*?)```", text, re.S).group(1)


def test_readme_custom_sampler_example_runs(capsys):
    code = _example()
    assert len(code.strip().splitlines()) < 25
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    assert capsys.readouterr().out.splitlines()[-1] == "RecentSampler passed"


def test_readme_example_fails_on_a_broken_sampler():
    """The example's check can fail: with the newest item off by one (the next slot to write,
    empty until the ring is full) check_sampler rejects it (the machine's own seeded bugs are
    in tests/core/testing/test_testing_machine.py)."""
    code = _example().replace("(ctx.cursor - 1 - age)", "(ctx.cursor - age)")
    assert code != _example()
    try:
        exec(compile(code.split("@settings")[0], "README.md", "exec"), {})
    except AssertionError as e:
        assert 'rule "drawn items are stored" is broken' in str(e)
    else:
        raise AssertionError("check_sampler accepted a sampler that draws empty slots")
