"""The README's quick start runs as written at every rank count (docs that cannot rot)."""

import os
import re

import pytest

from tests.support import REPO_ROOT

README = os.path.join(REPO_ROOT, "README.md")


def _quick_start() -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.mpi(min_size=1)
def test_readme_quick_start_runs(capsys):
    code = _quick_start()
    assert "buffer.dispatch(" in code and "buffer.combine(" in code
    namespace = {"__name__": "readme_quick_start"}
    exec(compile(code, "README.md:quick-start", "exec"), namespace)  # asserts inside must hold
    buffer = namespace["buffer"]
    # The backward passes returned real gradients: grad_x is the cached dispatch of ones.
    grad_x, recv_x = namespace["grad_x"], namespace["recv_x"]
    assert grad_x.shape == recv_x.shape and bool((grad_x == 1).all())
    assert buffer.get_traffic()["URMA"] == 0
