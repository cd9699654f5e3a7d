"""The README's Python examples run as written (on the CPU here)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_example_runs(index, capsys):
    exec(compile(SNIPPETS[index], f"README.md example {index}", "exec"), {})


def test_readme_has_examples():
    assert len(SNIPPETS) >= 2
