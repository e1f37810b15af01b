"""The engine as collaborators (engine/engine.py's docstring): no mixins sharing private fields, no part reading
another's private state, and the episode runner using only what engine/episode_runner.py's TurnEngine declares."""
from __future__ import annotations

import ast
import typing
from pathlib import Path

from rollout_service.engine.engine import Engine
from rollout_service.engine.episode_runner import TurnEngine

ENGINE_DIR = Path(__file__).resolve().parents[1] / "rollout_service" / "engine"
LIBRARY_PRIVATES = {"torch._C"}  # a library's own private module, not another part's state


def foreign_privates(source: str) -> list[str]:
    """`x._name` where x is not self / cls: a part reaching into another's private state."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if ast.unparse(node) not in LIBRARY_PRIVATES:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def engine_uses(source: str) -> set[str]:
    """The names read as `self.engine.<name>`."""
    return {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "engine" and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"}


def test_the_engine_is_a_class_of_its_own_not_a_stack_of_mixins():
    assert Engine.__bases__ == (object,)


def test_no_engine_part_reads_another_parts_private_state():
    bad = {p.name: f for p in sorted(ENGINE_DIR.glob("*.py")) if (f := foreign_privates(p.read_text()))}
    assert bad == {}


def test_the_episode_runner_uses_only_what_turn_engine_declares():
    declared = set(typing.get_type_hints(TurnEngine)) | {n for n in vars(TurnEngine) if not n.startswith("_")}
    used = engine_uses((ENGINE_DIR / "episode_runner.py").read_text())
    assert used and used <= declared, sorted(used - declared)


def test_the_checks_see_a_reach_into_private_state():
    """They can fail: another object's private field, and an engine member TurnEngine does not declare."""
    assert foreign_privates("def f(engine):\n    return engine._requests\n") == ["2: engine._requests"]
    assert foreign_privates("def f(self):\n    return self._requests, torch._C\n") == []
    assert engine_uses("class R:\n    def f(self):\n        self.engine.scheduler.add(1)\n") == {"scheduler"}
