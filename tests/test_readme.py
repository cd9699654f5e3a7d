"""The README's Python examples run as written (on the CPU here)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
#: Snippets that talk to a running ``mk serve`` run in tests/serve/test_server.py, against one.
SERVED = "http://127.0.0.1:8000"
ALL = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
SNIPPETS = [s for s in ALL if SERVED not in s]
SERVE_SNIPPETS = [s for s in ALL if SERVED in s]


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_example_runs(index, capsys):
    exec(compile(SNIPPETS[index], f"README.md example {index}", "exec"), {})


def test_readme_has_examples():
    assert len(SNIPPETS) >= 2 and len(SERVE_SNIPPETS) >= 1
