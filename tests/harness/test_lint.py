"""The repository passes its own lint configuration (``[tool.ruff]`` in ``pyproject.toml``)."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO_ROOT


def test_ruff_reports_nothing():
    """ruff is in the ``test`` extra (``scripts/setup.sh`` installs it), so a missing ruff fails here too."""
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
