"""Reward functions by name: "package.module:function", a def of one argument (the RolloutResult) returning a
finite float. `resolve` checks a name (reading the module's source before it ever runs) and imports it once
per process; `score` calls it on one result and never raises (rollout_service/rewards/runner.py runs them).
"""
from __future__ import annotations

import ast
import importlib
import importlib.machinery
import inspect
import math
import sys
from pathlib import Path
from typing import Callable, Iterable

from rollout_service.api.checks import check_reward_name
from rollout_service.api.types import RolloutResult
from rollout_service.user_code import Guard, describe_error, unguarded
from rollout_service.api.values import is_number

RewardFn = Callable[[RolloutResult], float]
_resolved: dict[str, RewardFn] = {}


def resolve(name: str, what: str = "reward") -> RewardFn:
    """The function named "module:function", imported once per process. A reward function is a `def` in a
    Python source module taking one argument (the result); a module not imported yet is checked by reading
    its source first, so a name that is not one (`this:s`, `http.server:test`) is refused before the module
    runs. ValueError naming `what`, the name and why."""
    check_reward_name(name, what)
    fn = _resolved.get(name)
    if fn is not None:
        return fn
    module_name, attr = name.split(":")
    where = f"{what}={name!r}"
    if module_name not in sys.modules:
        _check_source(module_name, attr, where)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while it is imported
        raise ValueError(f"{where}: cannot import module {module_name!r} ({type(e).__name__}: {e})") from None
    if not hasattr(module, attr):
        raise ValueError(f"{where}: module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn) or not inspect.isfunction(inspect.unwrap(fn)):
        raise ValueError(f"{where}: {attr!r} is a {type(fn).__name__}, not a function fn(result) -> float "
                         "defined with def in a Python module")
    _check_one_argument(inspect.signature(fn).parameters.values(), attr, where)
    _resolved[name] = fn
    return fn


def _check_source(module_name: str, attr: str, where: str) -> None:
    """That `attr` is a top-level def of one argument in the module's source, found and read without running
    the module or its packages."""
    path = None
    for i in range(module_name.count(".") + 1):
        name = ".".join(module_name.split(".")[:i + 1])
        spec = _top_level_spec(name) if i == 0 else importlib.machinery.PathFinder.find_spec(name, path)
        path = spec.submodule_search_locations if spec is not None else None
        if spec is None or (path is None and i < module_name.count(".")):
            raise ValueError(f"{where}: cannot import module {module_name!r}: no such module on the Python path")
    if not (spec.origin or "").endswith(".py"):
        raise ValueError(f"{where}: module {module_name!r} is not Python source ({spec.origin}): a reward "
                         "function is a def in a .py module")
    try:
        tree = ast.parse(Path(spec.origin).read_bytes(), spec.origin)
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{where}: cannot read module {module_name!r} ({type(e).__name__}: {e})") from None
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == attr]
    if not defs:
        raise ValueError(f"{where}: module {module_name!r} has no attribute {attr!r} that is a function defined "
                         f"with def at its top level ({spec.origin})")
    a = defs[-1].args
    positional = a.posonlyargs + a.args
    required = len(positional) - len(a.defaults)
    kw_required = sum(d is None for d in a.kw_defaults)
    if required != 1 or kw_required:
        raise ValueError(f"{where}: {attr}() must take one argument, the result; it needs "
                         f"{required + kw_required}")


def _top_level_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """A top-level package's spec as `import` would find it, without importing it: asked of every finder on
    sys.meta_path, since an editable install (`pip install -e`) is found by a finder of its own, not on sys.path."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__spec__", None) is not None:
        return module.__spec__
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        try:
            spec = find(name, None) if find else None
        except (ImportError, ValueError, AttributeError):
            continue
        if spec is not None:
            return spec
    return None


def _check_one_argument(params: Iterable[inspect.Parameter], attr: str, where: str) -> None:
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(required) != 1 or required[0].kind is inspect.Parameter.KEYWORD_ONLY:
        raise ValueError(f"{where}: {attr}() must take one argument, the result; it needs {len(required)}")


def _checked(value: object) -> float:
    # a bool is an int to Python, but a reward function returning one has most likely forgotten a conversion
    if not is_number(value):
        raise ValueError(f"the reward function returned a {type(value).__name__}, not a float")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"the reward function returned {value}, not a finite float")
    return value


def score(name: str, result: RolloutResult, guard: Guard = unguarded) -> tuple[float | None, str | None]:
    """(reward, None), or (None, "Type: message") when the function cannot be had, raises (SystemExit and
    KeyboardInterrupt too: it is the function's doing, not the caller's) or returns something other than a
    finite number. Never raises. The call is entered through `guard` (rollout_service/user_code.py)."""
    try:
        with guard(result.request_id, f"reward {name}"):
            return _checked(resolve(name)(result)), None
    except BaseException as e:
        return None, describe_error(e)


def score_all(name: str, results: list[RolloutResult],
              guard: Guard = unguarded) -> list[tuple[float | None, str | None]]:
    return [score(name, r, guard) for r in results]
