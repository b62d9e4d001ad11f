"""One exception hierarchy: every exception class the package defines lives in infinity/errors.py, derives from
infinity.InfinityError (so `except infinity.InfinityError` catches whatever infinity raises for a user to
handle), and keeps the built-in base a caller may already catch. Found by reading every module's source (an AST
walk), so a new exception class defined elsewhere fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import infinity
import infinity.errors as errors

PACKAGE = Path(infinity.__file__).parent


def _exception_classes(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            if any(b.endswith(("Error", "Exception", "Failure", "Exhausted")) or b in ("InfinityError",
                                                                                        "CheckpointError")
                   for b in bases) or node.name.endswith(("Error", "Failure")):
                yield node.name, bases


def test_exception_classes_are_defined_only_in_errors_py():
    elsewhere = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for name, bases in _exception_classes(ast.parse(path.read_text(), str(path))):
            elsewhere.append(f"{path.relative_to(PACKAGE)}: class {name}({', '.join(bases)})")
    assert not elsewhere, "define exceptions in infinity/errors.py under InfinityError:\n" + "\n".join(elsewhere)


@pytest.mark.parametrize("name,builtin", [
    ("ConfigError", ValueError), ("DataError", ValueError), ("NoPlacement", ValueError),
    ("SwapCorruptionError", OSError), ("CheckpointCorruptionError", OSError),
    ("PartitionedStateError", RuntimeError), ("RankFailure", RuntimeError), ("DirectoryInUse", RuntimeError),
    ("CheckpointError", RuntimeError), ("NoLatest", RuntimeError), ("PoolExhausted", TimeoutError)])
def test_each_is_an_infinity_error_and_keeps_its_builtin_base(name, builtin):
    cls = getattr(infinity, name)
    assert cls is getattr(errors, name)
    assert issubclass(cls, infinity.InfinityError) and issubclass(cls, builtin)


def test_every_class_in_errors_py_is_exported_and_under_the_base():
    defined = [n for n, _ in _exception_classes(ast.parse(Path(errors.__file__).read_text()))] + ["InfinityError"]
    assert set(defined) <= set(infinity.__all__)
    assert all(issubclass(getattr(errors, n), errors.InfinityError) for n in defined)


def test_a_raised_error_is_caught_by_the_base_with_its_message():
    from infinity.config import load_config

    with pytest.raises(infinity.InfinityError, match="zero_optimization.stage"):
        load_config({"zero_optimization": {"stage": 7}})
