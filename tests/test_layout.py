"""The test suite's own layout: a test module imports shared code from helper modules (or gets
it from a conftest fixture), never from another test module, so each test file can be read,
moved or run alone."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MODULES = sorted(TESTS.rglob("test_*.py"))


def imported_modules(tree: ast.AST) -> list[str]:
    """Every module an `import` or `from ... import` anywhere in `tree` names (a function's
    local imports included), as dotted names; `from a import b` gives both `a` and `a.b`
    (`b` may be a module)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found.append(base)
            found += [f"{base}.{alias.name}" if node.module else base + alias.name for alias in node.names]
    return found


def test_imported_modules_are_read_from_every_form_of_import():
    tree = ast.parse(
        "import a.test_x\nfrom tests.helpers import ROOT\nfrom . import test_y\ndef f():\n    from .test_z import g\n"
    )
    found = imported_modules(tree)
    assert {"a.test_x", "tests.helpers", "tests.helpers.ROOT", ".test_y", ".test_z", ".test_z.g"} <= set(found)


def test_no_test_module_imports_another():
    crossing = set()
    for path in MODULES:
        for name in imported_modules(ast.parse(path.read_text(), filename=str(path))):
            parts = name.split(".")
            tested = [i for i, part in enumerate(parts) if part.startswith("test_")]
            if tested:  # the test module itself, without the names taken from it
                crossing.add(f"{path.relative_to(TESTS.parent)} imports {'.'.join(parts[: tested[0] + 1])}")
    assert not crossing, "move what is shared into a helper module or a fixture:\n" + "\n".join(sorted(crossing))


def test_every_tier_names_files_that_exist():
    """The tiers go by path (`TIERS` in conftest.py): a path that matches no test file after a
    move would drop its tests from the tier silently."""
    from tests.conftest import TIERS

    files = [path.relative_to(TESTS).as_posix() for path in MODULES]
    unmatched = [(m, p) for m, prefixes in TIERS.items() for p in prefixes if not any(f.startswith(p) for f in files)]
    assert not unmatched


def test_every_folder_of_tests_is_a_package():
    """Each folder's `__init__.py` makes its files `tests.<folder>.test_x`: file names need only
    be unique within a folder, and helpers import as `tests.<folder>.helpers`."""
    assert not [str(p.parent) for p in MODULES if not (p.parent / "__init__.py").exists()]
