"""The test suite's own layout: test files share code only through ``tests/harness/``.

A test file that imports another test file drags that file's tests, fixtures and
import-time work along, and hides the helper a newcomer is looking for; a conftest
that imports a test file makes a cycle.  So: no module under ``tests/`` imports a
``test_*`` module or ``conftest``, except pytest itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def is_test_module(name: str) -> bool:
    return name == "conftest" or name.startswith("test_")


def forbidden_imports(path: Path) -> list[tuple[int, str]]:
    """The ``tests.test_*`` and ``tests.conftest`` modules ``path`` imports, with lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # relative: from . import x, from .test_x import y
            names = [f"tests.{node.module or ''}"] + [
                f"tests.{alias.name}" for alias in node.names if not node.module
            ]
        for name in names:
            parts = name.split(".")
            if parts[0] == "tests" and len(parts) > 1 and is_test_module(parts[1]):
                found.append((node.lineno, ".".join(parts[:2])))
    return sorted(set(found))


def test_no_test_file_imports_another_test_file_or_conftest() -> None:
    wrong = [
        f"{path.relative_to(TESTS.parent)}:{line} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in forbidden_imports(path)
    ]
    assert not wrong, "shared helpers belong in tests/harness/:\n" + "\n".join(wrong)


def test_the_check_sees_every_way_of_importing_a_test_file(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "from tests.test_router_http import req\n"
        "import tests.test_faults\n"
        "from tests import test_fuzz, harness\n"
        "from tests.conftest import StartRouter\n"
        "from .test_churn import x\n"
        "def f():\n    from tests.harness.http import req\n"
    )
    assert forbidden_imports(probe) == [
        (1, "tests.test_router_http"),
        (2, "tests.test_faults"),
        (3, "tests.test_fuzz"),
        (4, "tests.conftest"),
        (5, "tests.test_churn"),
    ]
