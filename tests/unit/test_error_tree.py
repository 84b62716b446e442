"""One error tree: every exception class of the product is drawn in koda/errors.py's
docstring, at its place by inheritance, and is a KodaError unless drawn in its "Not
errors" list with the reason.

The product's folders are parsed (the classes are found, never listed here): a class is
an exception class when a base's name ends in Error, Exception or Exit, or names another
exception class found. Each one is then imported to check what it derives from.
Failure mode provoked: a class planted in a scratch folder, outside KodaError and
undrawn, is reported on both counts; a drawn class that no longer exists, or one drawn
under the wrong parent, is reported too.
"""

from __future__ import annotations

import ast
import importlib
import re
import runpy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import koda_runtime.errors
from koda_runtime.errors import KodaError

ROOT = Path(__file__).resolve().parents[2]
NS = "koda_runtime"
# Checkout folder -> its import name (pyproject's package-dir); koda/ is the package.
FOLDERS = ("koda", "cli", "gateway", "processors", "scheduler", "topics", "schemas")
SUFFIXES = ("Error", "Exception", "Exit")
ERRORS_PY = "koda/errors.py"

Key = tuple[str, str]  # (class name, path from the checkout's root)


@dataclass(frozen=True)
class Found:
    name: str
    path: str
    line: int


def exception_classes(root: Path) -> list[Found]:
    """Every exception class defined under the product folders of ``root``."""
    classes: list[tuple[Found, list[str]]] = []
    for folder in FOLDERS:
        for file in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(file.read_text(), filename=str(file))
            path = file.relative_to(root).as_posix()
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                    classes.append((Found(node.name, path, node.lineno), bases))
    names: set[str] = set()
    found: dict[Key, Found] = {}
    grew = True
    while grew:
        grew = False
        for cls, bases in classes:
            key = (cls.name, cls.path)
            if key not in found and any(b.endswith(SUFFIXES) or b in names for b in bases):
                found[key] = cls
                names.add(cls.name)
                grew = True
    return sorted(found.values(), key=lambda c: (c.path, c.line))


@dataclass(frozen=True)
class Drawing:
    parent: dict[Key, Key | None]  # every drawn error class -> its drawn parent
    not_errors: set[Key]


_ENTRY = re.compile(r"^(?P<lead>[ │]*)(?:[├└]── )?(?P<name>[A-Za-z_]\w*)(?:\s+(?P<rest>.*))?$")


def _key(name: str, rest: str | None) -> Key:
    first = (rest or "").split(" ", 1)[0]
    return name, first if first.endswith(".py") else ERRORS_PY


def drawing(doc: str) -> Drawing:
    """The tree (from the line starting ``KodaError`` to the next blank line) and the
    entries of the block under the line starting ``Not errors``."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("KodaError"))
    indent = len(lines[start]) - len(lines[start].lstrip())
    parent: dict[Key, Key | None] = {}
    stack: list[Key] = []
    for i, line in enumerate(lines[start:]):
        if not line.strip():
            break
        match = _ENTRY.match(line)
        if i == 0 or "── " in line:
            assert match is not None, f"cannot read the tree's line {line!r}"
            depth = 0 if i == 0 else (line.index("── ") - 1 - indent) // 4 + 1
            key = _key(match["name"], match["rest"])
            assert key not in parent, f"{key[0]} ({key[1]}) is drawn twice"
            del stack[depth:]
            parent[key] = stack[-1] if stack else None
            stack.append(key)
    not_errors: set[Key] = set()
    heading = next((i for i, line in enumerate(lines) if line.startswith("Not errors")), None)
    if heading is not None:
        for line in lines[heading + 1 :]:
            if not line.strip():
                break
            words = line.split()
            if len(words) >= 2 and words[1].endswith(".py") and words[0].isidentifier():
                not_errors.add((words[0], words[1]))
    return Drawing(parent, not_errors)


def module_path(module: str, root: Path = ROOT) -> str:
    """koda_runtime.gateway.errors -> gateway/errors.py (a package: its __init__.py)."""
    parts = module.split(".")[1:]
    folder, rest = (parts[0], parts[1:]) if parts and parts[0] in FOLDERS[1:] else ("koda", parts)
    base = "/".join([folder, *rest])
    return f"{base}.py" if (root / f"{base}.py").exists() else f"{base}/__init__.py"


def import_class(cls: Found) -> type:
    parts = Path(cls.path).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    module = ".".join([NS, *parts[1:]] if parts[0] == "koda" else [NS, *parts])
    value = getattr(importlib.import_module(module), cls.name)
    assert isinstance(value, type), f"{module}.{cls.name} is not a class"
    return value


def problems(found: list[Found], doc: str, load: Callable[[Found], type]) -> list[str]:
    """What is wrong between the classes found and the drawing in ``doc``."""
    drawn = drawing(doc)
    out: list[str] = []
    keys = {(c.name, c.path) for c in found}
    for key in sorted(set(drawn.parent) | drawn.not_errors):
        if key not in keys:
            out.append(f"{key[0]} is drawn at {key[1]}, where no such exception class is")
    for cls in found:
        key, where = (cls.name, cls.path), f"{cls.name} ({cls.path}:{cls.line})"
        if key in drawn.not_errors:
            continue
        if key not in drawn.parent:
            out.append(f"{where} is not drawn in koda/errors.py's docstring")
        value = load(cls)
        if not issubclass(value, KodaError):
            out.append(f"{where} is not a KodaError and not drawn under 'Not errors'")
            continue
        if key not in drawn.parent or value is KodaError:
            continue
        base = next(b for b in value.__bases__ if issubclass(b, KodaError))
        expected = (base.__name__, module_path(base.__module__))
        if drawn.parent[key] != expected:
            out.append(f"{where} is drawn under {drawn.parent[key]}, but derives from {expected}")
    return out


def test_every_exception_class_is_drawn_and_a_koda_error() -> None:
    doc = koda_runtime.errors.__doc__
    assert doc is not None
    found = exception_classes(ROOT)
    assert len(found) > 40  # the walk found the product's classes
    wrong = problems(found, doc, import_class)
    assert not wrong, "\n".join(wrong)


PLANTED = '''
from koda_runtime.errors import ConfigError


class PlantedError(Exception):
    pass


class PlantedChild(PlantedError):
    """No suffix: an exception class because its base is one."""


class WrongPlace(ConfigError):
    pass


class NotAnError:
    pass
'''

PLANTED_DOC = """The tree.

    KodaError
    ├── ConfigError                a setting
    └── WrongPlace      processors/planted.py  drawn under the root, derives from ConfigError
        └── Vanished    processors/planted.py  no longer exists

Not errors:
    PlantedChild   processors/planted.py  a signal
"""


def test_a_planted_class_outside_the_tree_is_reported(tmp_path: Path) -> None:
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "koda" / "errors.py").write_text(
        "class KodaError(Exception): ...\n\n\nclass ConfigError(KodaError): ...\n"
    )
    (tmp_path / "processors" / "planted.py").write_text(PLANTED)
    namespace = runpy.run_path(str(tmp_path / "processors" / "planted.py"))

    def load(cls: Found) -> type:
        if cls.path == ERRORS_PY:
            return getattr(koda_runtime.errors, cls.name)
        return namespace[cls.name]

    found = exception_classes(tmp_path)
    assert [c.name for c in found] == [
        "KodaError",
        "ConfigError",
        "PlantedError",
        "PlantedChild",
        "WrongPlace",
    ]
    assert problems(found, PLANTED_DOC, load) == [
        "Vanished is drawn at processors/planted.py, where no such exception class is",
        "PlantedError (processors/planted.py:5) is not drawn in koda/errors.py's docstring",
        "PlantedError (processors/planted.py:5) is not a KodaError and not drawn under"
        " 'Not errors'",
        "WrongPlace (processors/planted.py:13) is drawn under ('KodaError', 'koda/errors.py'),"
        " but derives from ('ConfigError', 'koda/errors.py')",
    ]
