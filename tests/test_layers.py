"""The dependency rule, enforced: hashring <- router <- admin; nothing imports loadtests.

Every import statement of every module counts, lazy ones inside functions and
``TYPE_CHECKING`` blocks included (an arrow drawn only for the type checker is
still an arrow a reader follows).  Relative imports are resolved.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What each package may import from the project (itself always).
ALLOWED = {
    "hashring": set(),
    "router": {"hashring"},
    "admin": {"hashring", "router"},
    "loadtests": {"hashring", "router", "admin"},
}
PROJECT = set(ALLOWED) | {"tests"}


def imported(path: Path, root: Path = ROOT) -> set[tuple[str, int]]:
    """The project packages ``path`` imports, with the line of each import."""
    module = path.relative_to(root).with_suffix("").parts
    package = module if path.name == "__init__.py" else module[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names = [".".join((*base, node.module or ""))]
            else:
                names = [node.module or ""]
        for name in names:
            top = name.split(".")[0]
            if top in PROJECT:
                found.add((top, node.lineno))
    return found


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_goes_against_the_dependency_rule(package: str) -> None:
    allowed = ALLOWED[package] | {package}
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {top}"
        for path in modules(package)
        for top, line in sorted(imported(path))
        if top not in allowed
    ]
    assert not wrong, "\n".join(wrong)


def test_the_rule_sees_lazy_relative_and_type_checking_imports(tmp_path: Path) -> None:
    """The checker itself: each way of writing an import is found."""
    probe = tmp_path / "router" / "control" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from admin import app\n"
        "def f():\n    import loadtests.fleet\n"
        "from ...hashring import ring\n"
        "from .. import fleet\n"
    )
    assert imported(probe, tmp_path) == {
        ("admin", 3),
        ("loadtests", 5),
        ("hashring", 6),
        ("router", 7),
    }
