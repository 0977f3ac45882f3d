"""The README's quick start (``EPBuffer``) and its legacy-API example (V1 ``Buffer``) run as written at every
rank count (docs that cannot rot)."""

import os
import re

import pytest

from tests.support import REPO_ROOT

README = os.path.join(REPO_ROOT, "README.md")


def _snippet(heading: str) -> str:
    """The first ``python`` block after ``heading`` in the README."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run(code: str, name: str) -> dict:
    namespace = {"__name__": name}
    exec(compile(code, f"README.md:{name}", "exec"), namespace)  # asserts inside must hold
    return namespace


@pytest.mark.mpi(min_size=1)
def test_readme_quick_start_runs():
    code = _snippet("## Quick start")
    assert "EPBuffer(" in code and "buffer.dispatch(" in code and "buffer.combine(" in code
    namespace = _run(code, "quick_start")
    assert namespace["buffer"].runtime is None  # the example destroys its buffer


@pytest.mark.mpi(min_size=1)
def test_readme_legacy_example_runs():
    code = _snippet("### Legacy API")
    assert "Buffer(" in code and "buffer.dispatch(" in code and "buffer.combine(" in code
    namespace = _run(code, "legacy_example")
    buffer = namespace["buffer"]
    # The backward passes returned real gradients: grad_x is the cached dispatch of ones.
    grad_x, recv_x = namespace["grad_x"], namespace["recv_x"]
    assert grad_x.shape == recv_x.shape and bool((grad_x == 1).all())
    assert buffer.get_traffic()["URMA"] == 0
