"""The documentation stays consistent with the code (docs that cannot rot).

* Every section citation (the section sign followed by a number) in the package, the transports, the
  tests, the benchmarks and the scripts names, earlier on the same line, a ``docs/...md`` file that
  exists, and that file has a heading with that section number.
* Every relative link of ``README.md`` and of the pages under ``docs/`` resolves to a file, and an
  anchor to a heading of it.
* ``README.md`` stays a short guide (at most 300 lines).
* The table of environment variables in ``docs/configuration.md`` is ``settings.markdown_table()``.
"""

from __future__ import annotations

import os
import re

import pytest

from deepep_ascend import settings
from tests.support import REPO_ROOT

SECTION = "\u00a7"
CITED_TREES = ("deepep_ascend", "transports", "tests", "bench", "scripts")
TEXT_SUFFIXES = (".py", ".sh", ".c", ".h", ".toml", ".txt", ".md")
MAX_README_LINES = 300

_DOC_PATH = re.compile(r"docs/[\w./-]+?\.md")
_CITATION = re.compile(SECTION + r"\s?(\d+(?:\.\d+)*)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_TABLE_BEGIN, _TABLE_END = "<!-- settings-table:begin -->", "<!-- settings-table:end -->"


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _headings(path: str) -> list[str]:
    """The heading texts of a markdown file, outside fenced code blocks."""
    out, fenced = [], False
    for line in _read(path).splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            out.append(m.group(1))
    return out


def _section_numbers(path: str) -> set[str]:
    """Numbers that open a heading: ``## 4. Normal mode`` gives ``4``, ``### 4.3 Handle`` gives ``4.3``."""
    nums = set()
    for text in _headings(path):
        m = re.match(r"(\d+(?:\.\d+)*)\.?(?:\s|$)", text)
        if m:
            nums.add(m.group(1))
    return nums


def _slug(text: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    seen, out = {}, set()
    for text in _headings(path):
        slug = _slug(text)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _cited_files():
    for tree in CITED_TREES:
        for root, dirs, files in os.walk(os.path.join(REPO_ROOT, tree)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", ".venv") and not d.startswith(".")]
            for name in sorted(files):
                if name.endswith(TEXT_SUFFIXES):
                    yield os.path.join(root, name)


def citation_problems() -> list[str]:
    """Each section citation that names no existing docs file, or no heading of it, as ``path:line: why``."""
    problems, numbers = [], {}
    for path in _cited_files():
        try:
            text = _read(path)
        except UnicodeDecodeError:
            continue
        rel = os.path.relpath(path, REPO_ROOT)
        for lineno, line in enumerate(text.splitlines(), 1):
            for cite in _CITATION.finditer(line):
                docs = [m for m in _DOC_PATH.finditer(line) if m.end() <= cite.start()]
                where = f"{rel}:{lineno}: {cite.group(0)!r}"
                if not docs:
                    problems.append(f"{where} names no docs/...md file before it on its line")
                    continue
                doc = docs[-1].group(0)
                target = os.path.join(REPO_ROOT, doc)
                if not os.path.isfile(target):
                    problems.append(f"{where} cites {doc}, which does not exist")
                    continue
                if doc not in numbers:
                    numbers[doc] = _section_numbers(target)
                if cite.group(1) not in numbers[doc]:
                    problems.append(f"{where} cites a section that {doc} has no heading for")
    return problems


def _markdown_files() -> list[str]:
    files = [os.path.join(REPO_ROOT, "README.md")]
    for root, _dirs, names in os.walk(os.path.join(REPO_ROOT, "docs")):
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".md")]
    return files


def link_problems() -> list[str]:
    """Each relative link of README.md and docs/ whose file or anchor does not exist."""
    problems = []
    for path in _markdown_files():
        rel, fenced = os.path.relpath(path, REPO_ROOT), False
        for lineno, line in enumerate(_read(path).splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                continue
            for m in _LINK.finditer(re.sub(r"`[^`]*`", "", line)):
                target = m.group(1)
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
                if not os.path.exists(dest):
                    problems.append(f"{rel}:{lineno}: link {target!r}: {file_part} does not exist")
                elif anchor and (not dest.endswith(".md") or anchor not in _anchors(dest)):
                    problems.append(f"{rel}:{lineno}: link {target!r}: no heading with anchor #{anchor}")
    return problems


def test_every_section_citation_names_an_existing_docs_section():
    problems = citation_problems()
    assert not problems, "\n".join(problems)


def test_every_relative_link_in_the_docs_resolves():
    problems = link_problems()
    assert not problems, "\n".join(problems)


def test_readme_is_a_short_guide():
    lines = _read(os.path.join(REPO_ROOT, "README.md")).count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail to docs/"


def test_configuration_table_is_the_settings_table():
    text = _read(os.path.join(REPO_ROOT, "docs", "configuration.md"))
    assert _TABLE_BEGIN in text and _TABLE_END in text, "docs/configuration.md lost its settings-table markers"
    table = text.split(_TABLE_BEGIN, 1)[1].split(_TABLE_END, 1)[0].strip("\n") + "\n"
    assert table == settings.markdown_table(), (
        "docs/configuration.md's table differs from deepep_ascend.settings; paste the output of "
        "`python -m deepep_ascend.settings` between its markers")


@pytest.mark.parametrize("line, ok", [
    ("see docs/semantics/deepep-api.md \u00a74.3 and \u00a75", True),
    ("see docs/semantics/deepep-api.md \u00a799", False),
    ("see \u00a74.3", False),
    ("see docs/nowhere.md \u00a71", False),
])
def test_the_citation_check_itself(tmp_path, monkeypatch, line, ok):
    """The checker finds what it should on a file of one line (so a broken checker cannot pass silently)."""
    pkg = tmp_path / "bench"
    pkg.mkdir()
    (pkg / "x.py").write_text(f"# {line}\n", encoding="utf-8")
    (tmp_path / "docs" / "semantics").mkdir(parents=True)
    (tmp_path / "docs" / "semantics" / "deepep-api.md").write_text(
        "# Title\n\n## 4. Normal\n\n### 4.3 Handle\n\n## 5. Internode\n", encoding="utf-8")
    monkeypatch.setattr(f"{__name__}.REPO_ROOT", str(tmp_path))
    assert (citation_problems() == []) is ok
