"""The architecture, held against the code: which room of the package may import which, and no private
name crossing a room's wall (docs/design/architecture.md draws the same picture).

Read from the source with :mod:`ast`, nothing imported: every ``import``/``from`` in ``deepep_ascend/``
and ``transports/`` (installed as ``deepep_ascend.transports``) is resolved to the room it reaches.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

import pytest

from tests.support import REPO_ROOT

# Room -> the rooms it may import. ``settings`` (environment variables), ``checks`` (argument checks
# shared by every room), ``ordering`` (stable orders of small integer keys), ``rounding`` (ceil_div, align) and
# ``host`` (the host's memory) are leaves every room may read; the package's face (``deepep_ascend/__init__.py``)
# may import every room.
LEAVES = {"settings", "checks", "ordering", "rounding", "host"}
ALLOWED = {
    "settings": set(),
    "checks": set(),
    "ordering": set(),
    "rounding": set(),
    "host": set(),
    "transports": {"settings"},
    "native": LEAVES,
    "gemm": {"native"} | LEAVES,
    "ep": {"transports", "native", "gemm"} | LEAVES,
    "mega_moe": {"ep", "gemm", "native", "transports"} | LEAVES,
    "nn": {"ep", "gemm", "transports"} | LEAVES,
    "utils": {"ep", "gemm"} | LEAVES,  # deep_ep.utils' names, re-exported
}
ROOMS = set(ALLOWED)
# Public API spelled with an underscore so as not to clash with field names (``typing.NamedTuple``).
NAMEDTUPLE_API = {"_make", "_replace", "_asdict", "_fields", "_field_defaults"}


def _sources() -> Iterator[tuple[str, str]]:
    """(path relative to the repository, dotted module name) of every library source."""
    for folder, package in (("deepep_ascend", "deepep_ascend"), ("transports", "deepep_ascend.transports")):
        root = os.path.join(REPO_ROOT, folder)
        for dirpath, _, files in os.walk(root):
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                yield os.path.relpath(os.path.join(dirpath, f), REPO_ROOT), ".".join([package, *rel])


def _room(module: str) -> str | None:
    """The room of a dotted module inside the package; ``""`` for the package's face; None outside."""
    parts = module.split(".")
    if parts[0] != "deepep_ascend":
        return None
    if len(parts) == 1:
        return ""
    return parts[1] if parts[1] in ROOMS else ""


def _is_package(path: str) -> bool:
    return path.endswith("__init__.py")


def _parse(path: str) -> ast.Module:
    with open(os.path.join(REPO_ROOT, path)) as f:
        return ast.parse(f.read(), path)


def _imports(path: str, module: str, tree: ast.Module | None = None) -> Iterator[tuple[ast.stmt, str, list]]:
    """(node, imported module, aliases taken from it) of every import in ``path``, relative ones resolved."""
    package = module if _is_package(path) else module.rpartition(".")[0]
    for node in ast.walk(tree or _parse(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")
                target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            yield node, target, list(node.names)


def _edges():
    for path, module in _sources():
        me = _room(module)
        for node, target, aliases in _imports(path, module):
            yield path, node.lineno, me, target, [a.name for a in aliases]


def test_rooms_import_only_the_rooms_below_them():
    bad = []
    for path, line, me, target, names in _edges():
        if target == "transports" or target.startswith("transports."):
            bad.append(f"{path}:{line}: imports the checkout's top-level `transports` (use deepep_ascend.transports)")
            continue
        other = _room(target)
        if other is None or me == "":
            continue
        if other == "":  # `from deepep_ascend import X`: X names a room or a re-export of the face
            rooms = {n for n in names if n in ROOMS} or {"the package face"}
        else:
            rooms = {other}
        for r in rooms - {me} - ALLOWED[me]:
            bad.append(f"{path}:{line}: room {me!r} imports {r!r} ({target}); allowed: {sorted(ALLOWED[me])}")
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_a_room():
    """``from <other room> import _x`` and ``<module of another room>._x`` are both refused: what one room
    shares with another is public, named in a module of its own."""
    bad = []
    for path, module in _sources():
        me = _room(module)
        tree = _parse(path)
        aliases = {}  # local name -> (room, dotted name) it stands for
        for node, target, names in _imports(path, module, tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    aliases[a.asname or a.name.split(".")[0]] = (_room(a.name), a.name)
                continue
            for a in names:
                full = f"{target}.{a.name}"
                aliases[a.asname or a.name] = (_room(full) or _room(target), full)
                if _room(target) not in (None, me) and a.name.startswith("_") and not a.name.startswith("__"):
                    bad.append(f"{path}:{node.lineno}: imports the private name {a.name} from {target}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in NAMEDTUPLE_API
                    and node.value.id in aliases):
                room, target = aliases[node.value.id]
                if room not in (None, me):
                    bad.append(f"{path}:{node.lineno}: reads the private {target}.{node.attr} of room {room!r}")
    assert not bad, "\n".join(bad)


def test_transports_import_nothing_of_the_library_but_settings():
    """The transports know bytes, ranks and signals: they may read the settings leaf, nothing else above."""
    bad = [f"{path}:{line}: {target}" for path, line, me, target, _ in _edges()
           if me == "transports" and _room(target) not in (None, "transports", "settings")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder", ["tests", "bench", "scripts"])
def test_tools_never_import_the_top_level_transports(folder):
    """A bare ``import transports`` from a checkout loads a second copy of the package (other classes, other
    state) beside ``deepep_ascend.transports``."""
    bad = []
    for dirpath, _, files in os.walk(os.path.join(REPO_ROOT, folder)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                for node in ast.walk(_parse(path)):
                    names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                             else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                    bad += [f"{os.path.relpath(path, REPO_ROOT)}:{node.lineno}: {n}" for n in names
                            if n == "transports" or n.startswith("transports.")]
    assert not bad, "\n".join(bad)


def test_the_rule_table_names_every_room_on_disk():
    """A new room must be placed in the picture before it can hold code."""
    on_disk = {d for d in os.listdir(os.path.join(REPO_ROOT, "deepep_ascend"))
               if os.path.isfile(os.path.join(REPO_ROOT, "deepep_ascend", d, "__init__.py"))}
    assert on_disk | LEAVES | {"transports"} == ROOMS, sorted(on_disk)
