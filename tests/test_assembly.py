"""The engine's assembly, read from the source: each object's fields are written by its own class only, and the
config's tiers are parsed in one place (issue "Engine assembled from one typed plan").

A field written from outside its class is wiring that no constructor shows: the reader of ParamStore cannot
tell, from ParamStore, what its fields hold or when they change."""

from __future__ import annotations

import ast
import pathlib

import infinity

PACKAGE = pathlib.Path(infinity.__file__).parent
# How code outside ParamStore, ShardedAdam and Engine names their instances (`store`, `self.store`,
# `engine.optimizer`, ...).
RECEIVERS = {"store", "_store", "optimizer", "_optimizer", "opt", "engine", "_engine", "model_engine"}


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _receiver(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def violations(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, code) of every attribute written, deleted or setattr'd on a store, an optimizer or an engine named
    as outside code names them. Inside their own classes they are `self`, so any hit is an outside write: a
    field of theirs, or a new attribute patched on."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                and _receiver(node.value) in RECEIVERS:
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and _receiver(node.func) in ("setattr", "delattr") and node.args \
                and _receiver(node.args[0]) in RECEIVERS:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_field_of_the_store_the_optimizer_or_the_engine_is_assigned_outside_its_class():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {code}"
             for path, tree in _sources() for line, code in violations(tree)]
    assert not found, "attributes written from outside their class:\n" + "\n".join(found)


def test_the_scan_finds_an_assignment_from_outside():
    """The check above can fail: its scan flags a field written from outside, a new attribute patched on, and a
    setattr, and leaves the classes' own `self.x = ...` alone."""
    tree = ast.parse("def wire(store, engine):\n    store.scheduler = None\n    engine.optimizer.grad_for = f\n"
                     "    setattr(store, 'x', 1)\n"
                     "class ParamStore:\n    def __init__(self):\n        self.scheduler = None\n")
    assert [line for line, _ in violations(tree)] == [2, 3, 4]


def test_tiers_are_parsed_in_the_config_only():
    found = []
    for path, tree in _sources():
        if path.parent == PACKAGE / "config":
            continue
        for node in ast.walk(tree):
            parse = isinstance(node, ast.Call) and _receiver(node.func) == "Tier"
            lookup = isinstance(node, ast.Subscript) and _receiver(node.value) == "Tier"
            if parse or lookup:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "Tier parsed outside infinity/config/ (read the section's .tier instead):\n" + \
        "\n".join(found)


def test_the_engine_module_holds_the_training_path_only():
    """engine.py is forward, backward and step; the assembly, DeepSpeed's surface and the report live beside it."""
    lines = (PACKAGE / "engine" / "engine.py").read_text().count("\n")
    assert lines < 400, f"infinity/engine/engine.py has {lines} lines"
