"""The README's example is run exactly as printed, so it cannot drift from the library."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_prints_the_shapes_it_claims(capsys):
    text = README.read_text()
    code = re.search(r"## A 15-line example\n\n```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 15
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("(256, 4) (256,) (256,) (256,)")
    assert out[1] == "32 True"
