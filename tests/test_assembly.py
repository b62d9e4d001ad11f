"""The engine's assembly, read from the source: each object's fields are written by its own class only, and the
config's tiers are parsed in one place (issue "Engine assembled from one typed plan").

A field written from outside its class is wiring that no constructor shows: the reader of ParamStore cannot
tell, from ParamStore, what its fields hold or when they change."""

from __future__ import annotations

import ast
import pathlib

import infinity
from infinity.engine.engine import Engine
from infinity.engine.optimizer import ShardedAdam
from infinity.engine.params import ParamStore

PACKAGE = pathlib.Path(infinity.__file__).parent
CLASSES = (ParamStore, ShardedAdam, Engine)
# How code outside these classes names their instances (`store`, `self.store`, `engine.optimizer`, ...).
RECEIVERS = {"store": ParamStore, "_store": ParamStore, "optimizer": ShardedAdam, "_optimizer": ShardedAdam,
             "opt": ShardedAdam, "engine": Engine, "_engine": Engine}


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _fields(cls) -> set[str]:
    """The attributes `cls`'s own methods assign on self."""
    import inspect

    tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def _receiver(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def test_no_field_of_the_store_the_optimizer_or_the_engine_is_assigned_outside_its_class():
    fields = {cls: _fields(cls) for cls in CLASSES}
    assert {"tier", "params", "scheduler"} <= fields[ParamStore], "the scan must see the classes' fields"
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del))):
                continue
            cls = RECEIVERS.get(_receiver(node.value))
            if cls is not None and node.attr in fields[cls]:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)} "
                             f"({cls.__name__}.{node.attr})")
    assert not found, "fields assigned outside their class:\n" + "\n".join(found)


def test_the_scan_finds_an_assignment_from_outside():
    """The check above can fail: the same walk flags a planted assignment."""
    tree = ast.parse("def wire(store):\n    store.scheduler = None\n")
    hits = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and RECEIVERS.get(_receiver(n.value)) is ParamStore and n.attr in _fields(ParamStore)]
    assert len(hits) == 1


def test_tiers_are_parsed_in_the_config_only():
    found = []
    for path, tree in _sources():
        if path.parent.name == "config" or path.name == "tier.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _receiver(node.func) == "Tier":
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "Tier(...) parsed outside infinity/config/ (read the section's .tier instead):\n" + \
        "\n".join(found)


def test_the_engine_module_holds_the_training_path_only():
    """engine.py is forward, backward and step; the assembly, DeepSpeed's surface and the report live beside it."""
    lines = (PACKAGE / "engine" / "engine.py").read_text().count("\n")
    assert lines < 400, f"infinity/engine/engine.py has {lines} lines"
