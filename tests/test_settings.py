"""``deepep_ascend.settings``: every environment variable declared once, parsed one way, refused by name."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from deepep_ascend import settings
from deepep_ascend.settings import SETTINGS, Setting, SettingError
from tests.support import REPO_ROOT

# A good and a bad raw value per kind, and what the good one parses to.
GOOD = {"float": (" 2.5 ", 2.5), "int": ("7", 7), "bool": ("Yes", True), "text": (" a b ", "a b")}
BAD = {"float": ["abc", "nan", "inf", "-inf", "1e"], "int": ["2.5", "x", "0x10"], "bool": ["2", "maybe"]}


def _good(s: Setting):
    if s.kind == "choice":
        return s.choices[-1], s.choices[-1]
    raw, value = GOOD[s.kind]
    if s.minimum is not None and value < s.minimum + (1 if s.exclusive else 0):
        value = int(s.minimum) + 3
        raw = str(value)
    return raw, value


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_setting_parses_one_way(name):
    s = SETTINGS[name]
    assert s.name == name and s.meaning and s.scope in ("library", "tests", "scripts")
    assert s.get({}) == s.default and s.get({name: "  "}) == s.default  # unset and blank alike
    raw, value = _good(s)
    assert s.get({name: raw}) == value
    bad = list(BAD.get(s.kind, []))
    if s.kind == "choice":
        bad += ["", "nope", s.choices[0].upper() if s.choices[0].upper() != s.choices[0] else "X" + s.choices[0]]
        bad.remove("")
    if s.minimum is not None:
        bad.append(str(int(s.minimum) - 1 if not s.exclusive else int(s.minimum)))
    if s.limit is not None:  # the last value below the limit is taken, the limit is not
        assert s.get({name: str(s.limit - 1)}) == s.limit - 1
        bad.append(str(s.limit))
    for b in bad:
        with pytest.raises(SettingError) as info:
            s.get({name: b})
        assert f"${name} must be" in str(info.value) and repr(b) in str(info.value), str(info.value)
        assert isinstance(info.value, ValueError)


def test_read_at_use_not_at_import(monkeypatch):
    """A launcher or test may set a variable between two calls: nothing is cached."""
    monkeypatch.setenv(settings.TIMEOUT_S.name, "3")
    assert settings.TIMEOUT_S.get() == 3.0
    monkeypatch.setenv(settings.TIMEOUT_S.name, "4")
    assert settings.TIMEOUT_S.get() == 4.0


def _bad_value(s: Setting) -> str:
    return "nope" if s.kind == "choice" else BAD[s.kind][0] if s.kind in BAD else str(int(s.minimum) - 1)


_RECORD_IMPORT_READS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("deepep_ascend.settings", sys.argv[1])
settings = importlib.util.module_from_spec(spec)
sys.modules["deepep_ascend.settings"] = settings
spec.loader.exec_module(settings)
read, get = [], settings.Setting.get
settings.Setting.get = lambda self, *a, **k: (read.append(self.name), get(self, *a, **k))[1]
import deepep_ascend
print(" ".join(sorted(set(read))))
"""


def test_only_the_variables_said_read_at_import_are_read_there():
    """docs/configuration.md: a library variable is read where it is used, except the native kernels' switches, which
    the table says are read "when deepep_ascend is imported" (a bad value of one of them stops the import). Importing
    the package reads exactly those, and bad values of all the others together let it import."""
    at_import = sorted(n for n, s in SETTINGS.items()
                       if s.scope == "library" and "when deepep_ascend is imported" in s.meaning)
    assert settings.NATIVE.name in at_import and len(at_import) == 6, at_import
    others = {n: _bad_value(s) for n, s in SETTINGS.items() if s.scope == "library" and n not in at_import
              and (s.kind in BAD or s.kind == "choice" or s.minimum is not None)}
    assert settings.TIMEOUT_S.name in others and settings.LL_FUSED.name in others, others
    env = {**{k: v for k, v in os.environ.items() if k not in SETTINGS}, **others}
    proc = subprocess.run([sys.executable, "-c", _RECORD_IMPORT_READS, settings.__file__], cwd="/", env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == at_import, proc.stdout
    env[settings.LL_STREAM_SENDS.name] = "sometimes"  # one of them bad: the import stops, naming it
    proc = subprocess.run([sys.executable, "-c", "import deepep_ascend"], cwd="/", env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith(
        f"deepep_ascend.settings.SettingError: ${settings.LL_STREAM_SENDS.name} must be"), proc.stderr


def _files(*folders, suffixes=(".py", ".sh", ".md", ".toml", "")):
    for folder in folders:
        root = os.path.join(REPO_ROOT, folder)
        if os.path.isfile(root):
            yield root
            continue
        for dirpath, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", ".venv", "build")]
            for f in files:
                if os.path.splitext(f)[1] in suffixes:
                    yield os.path.join(dirpath, f)


def test_every_variable_named_in_the_repository_is_declared():
    named = {}
    for path in _files("deepep_ascend", "transports", "tests", "bench", "scripts", "docs", ".ci", "README.md",
                       "pyproject.toml"):
        with open(path, errors="replace") as f:
            for m in re.finditer(r"\bDEEPEP_ASCEND_[A-Z0-9_]*[A-Z0-9]", f.read()):
                named.setdefault(m.group(0), os.path.relpath(path, REPO_ROOT))
    missing = {n: where for n, where in named.items() if n not in SETTINGS}
    assert not missing, f"undeclared in deepep_ascend/settings.py: {missing}"


def test_the_library_reads_variables_only_through_settings():
    """No ``os.environ``/``os.getenv`` read of a declared variable outside the settings module."""
    reads = re.compile(r"(environ\s*(\.get\s*\(|\[)|getenv\s*\()\s*[\"'](" + "|".join(SETTINGS) + r")[\"']")
    bad = []
    for path in _files("deepep_ascend", "transports", "bench", "scripts", "tests/conftest.py", suffixes=(".py",)):
        if path.endswith(os.path.join("deepep_ascend", "settings.py")):
            continue
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if reads.search(line):
                    bad.append(f"{os.path.relpath(path, REPO_ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_check_command_names_every_bad_variable():
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    env.update(DEEPEP_ASCEND_TIMEOUT_S="soon", DEEPEP_ASCEND_TEST_EXIT_MODE="maybe", DEEPEP_ASCEND_RANKS_PER_NODE="4")
    proc = subprocess.run([sys.executable, "-m", "deepep_ascend", "settings", "check"], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc
    assert "$DEEPEP_ASCEND_TIMEOUT_S must be a finite number > 0, got 'soon'" in proc.stderr, proc.stderr
    assert "DEEPEP_ASCEND_TEST_EXIT_MODE" in proc.stderr and "RANKS_PER_NODE" not in proc.stderr, proc.stderr
    # By path, without importing the package: a bad DEEPEP_ASCEND_NATIVE (read when the package loads) is named
    # with the others instead of stopping the check.
    env["DEEPEP_ASCEND_NATIVE"] = "maybe"
    script = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "deepep_ascend", "settings.py"), "check"],
                            env=env, cwd="/", capture_output=True, text=True, timeout=120)
    assert script.returncode == 1 and "$DEEPEP_ASCEND_NATIVE must be a boolean" in script.stderr, script
    assert "$DEEPEP_ASCEND_TIMEOUT_S must be a finite number > 0, got 'soon'" in script.stderr, script.stderr
    table = subprocess.run([sys.executable, "-m", "deepep_ascend", "settings"], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=120, env={k: v for k, v in os.environ.items() if k not in SETTINGS})
    assert table.returncode == 0 and table.stdout == settings.markdown_table()
    assert all(f"`{name}`" in table.stdout for name in SETTINGS)


def test_get_command_prints_the_parsed_value_for_the_scripts(monkeypatch, capsys):
    # scripts/test.sh reads its numbers this way: "010" is ten there, not eight (bash reads it as octal), and
    # "2_0" twenty (Python's integer syntax), above the limit of DEEPEP_ASCEND_TEST_SHARDS
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    cases = [("DEEPEP_ASCEND_TEST_SHARDS", None, "2"), ("DEEPEP_ASCEND_TEST_SHARDS", "08", "8"),
             ("DEEPEP_ASCEND_TEST_SHARDS", "2_0", None), ("DEEPEP_ASCEND_TEST_SHARDS", "8", "8"),
             ("DEEPEP_ASCEND_TEST_SHARDS", "9", None), ("DEEPEP_ASCEND_TEST_HANG_RETRIES", " 010 ", "10"),
             ("DEEPEP_ASCEND_TEST_LOCAL_EVERY_RANK", "yes", "1"), ("DEEPEP_ASCEND_TEST_LOG_DIR", None, "")]
    for name, raw, printed in cases:
        if raw is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, raw)
        status = settings.main(["get", name])
        out, err = capsys.readouterr()
        if printed is None:
            assert status == 1 and out == "" and f"${name} must be" in err and repr(raw) in err, (name, raw, err)
        else:
            assert status == 0 and out == printed + "\n" and err == "", (name, raw, out, err)
    for argv, needle in ((["get"], "goes with get"), (["check", "X"], "goes with get"),
                         (["get", "NOT_A_SETTING"], "'NOT_A_SETTING' is not a declared variable")):
        with pytest.raises(SystemExit) as exit_info:
            settings.main(argv)
        assert exit_info.value.code == 2 and needle in capsys.readouterr().err, argv
