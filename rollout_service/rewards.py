"""Rewards computed by the service, where the results are.

A reward function is named by an importable "package.module:function" (signature `fn(result) -> float`;
a result carries its request's `metadata`, e.g. the ground truth). The name travels with the request (or
is the service's default) and is resolved once per process. A function that raises, or returns anything
but a finite number, marks that one result (`reward=None`, `reward_error` says why); the others go on.

`RewardRunner` computes rewards off the caller's thread, so that a slow reward function does not hold up
the engine: in a small thread pool, or wherever its `start` sends them (actors/reward_pool.py).
"""
from __future__ import annotations

import ast
import importlib
import importlib.machinery
import inspect
import math
import numbers
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

from rollout_service.checks import check_reward_name
from rollout_service.types import RolloutResult
from rollout_service.user_code import Guard, describe_error, unguarded

RewardFn = Callable[[RolloutResult], float]
# start(name, results) -> a Future of one (reward, reward_error) per result
Starter = Callable[[str, list[RolloutResult]], "Future[list[tuple[float | None, str | None]]]"]

REWARD_THREADS = 4  # a worker's (or local client's) reward threads when no reward actors are configured

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
        spec = importlib.machinery.PathFinder.find_spec(".".join(module_name.split(".")[:i + 1]), path)
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


def _check_one_argument(params: Iterable[inspect.Parameter], attr: str, where: str) -> None:
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(required) != 1 or required[0].kind is inspect.Parameter.KEYWORD_ONLY:
        raise ValueError(f"{where}: {attr}() must take one argument, the result; it needs {len(required)}")


def _checked(value: object) -> float:
    # a bool is an int to Python, but a reward function returning one has most likely forgotten a conversion
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
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


def wants_reward(result: RolloutResult) -> bool:
    """Rewards are for finished samples: not for aborted or failed ones, nor for a result that carries a
    reward already (an episode's, from its environment)."""
    return result.finish_reason != "abort" and result.error is None and result.reward is None


class RewardBook:
    """Which reward function each request in flight wants, until its n samples have come out."""

    def __init__(self, default: str | None = None):
        self.default = default
        self._lock = threading.Lock()  # (results come out of the engine's thread and of abort's)
        self._names: dict[str, list] = {}  # request id -> [reward name, samples still to come]

    def name_for(self, request) -> str | None:
        """The request's reward name (its own, else the default), resolved here: ValueError if it cannot be."""
        name = request.reward or self.default
        if name is not None:
            resolve(name, f"request {request.request_id!r}: reward")
        return name

    def add(self, request_id: str, name: str | None, n: int) -> None:
        if name is not None:
            with self._lock:
                self._names[request_id] = [name, n]

    def take(self, result: RolloutResult) -> str | None:
        """The reward name for this result (None: no reward to compute); counts the request's samples."""
        with self._lock:
            entry = self._names.get(result.request_id)
            if entry is None:
                return None
            entry[1] -= 1
            if entry[1] <= 0:
                del self._names[result.request_id]
        return entry[0] if wants_reward(result) else None


class RewardRunner:
    """Computes rewards off the caller's thread and hands the results, their rewards set, to `on_ready`
    (from another thread). `start(name, results)` -> Future of one (reward, reward_error) per result;
    default: this process's reward threads, each call entered through `guard`. Results that finish together
    are scored in up to `parts` batches, not one by one: a handful of hand-offs per engine step instead of
    one per result. A result whose request is aborted before its reward is computed comes back from `cancel`
    instead, marked, and never reaches `on_ready`."""

    def __init__(self, on_ready: Callable[[list[RolloutResult]], None], start: Starter | None = None,
                 parts: int = REWARD_THREADS, guard: Guard = unguarded):
        self._on_ready = on_ready
        self._start = start or self._in_thread
        self._parts = parts
        self._guard = guard  # around each reward call in this process's threads
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], RolloutResult] = {}

    @property
    def pending(self) -> int:
        return len(self._pending)

    def finished(self, results: list[RolloutResult], book: RewardBook) -> list[RolloutResult]:
        """Send the results that want a reward (per `book`) to be scored; returns the others."""
        ready: list[RolloutResult] = []
        by_name: dict[str, list[RolloutResult]] = {}
        for r in results:
            name = book.take(r)
            if name is None:
                ready.append(r)
            else:
                by_name.setdefault(name, []).append(r)
        for name, rs in by_name.items():
            self.submit(name, rs)
        return ready

    def submit(self, name: str, results: list[RolloutResult]) -> None:
        parts = max(1, min(self._parts, len(results)))
        for i in range(parts):
            batch = results[i::parts]
            keys = [(r.request_id, r.sample_index) for r in batch]
            with self._lock:
                self._pending.update(zip(keys, batch))
            try:
                future = self._start(name, batch)
            except Exception as e:  # e.g. a shut-down pool: the results must still come out
                future = Future()
                future.set_exception(e)
            future.add_done_callback(lambda f, keys=keys: self._done(keys, f))

    def _in_thread(self, name: str, results: list[RolloutResult]) -> Future:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._parts, thread_name_prefix="reward")
        return self._executor.submit(score_all, name, results, self._guard)

    def _done(self, keys: list[tuple[str, int]], future: Future) -> None:
        try:
            scores = list(future.result())
        except BaseException as e:  # (a cancelled future raises CancelledError, a BaseException)
            scores = [(None, f"the reward could not be computed: {type(e).__name__}: {e}")] * len(keys)
        ready = []
        with self._lock:
            for key, (reward, error) in zip(keys, scores):
                result = self._pending.pop(key, None)
                if result is not None:  # (None: cancelled meanwhile, it went back through cancel())
                    result.reward, result.reward_error = reward, error
                    ready.append(result)
        if ready:
            self._on_ready(ready)

    def cancel(self, request_ids: Iterable[str]) -> list[RolloutResult]:
        """Take back the results of these requests still waiting for their reward, marked as such."""
        ids = set(request_ids)
        with self._lock:
            keys = [k for k in self._pending if k[0] in ids]
            out = [self._pending.pop(k) for k in keys]
        for r in out:
            r.reward_error = "aborted before its reward was computed"
        return out

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
