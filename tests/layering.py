"""The project's module graph, read from the sources (no imports run): which file imports which, the layer
each file belongs to, import circles and imports up a layer. tests/test_layers.py asserts on it and
scripts/import_graph.py prints it.

Layers, bottom to top (docs/layout.md): a module may import from its own layer or any layer below.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollout_service", "actors", "benchmarks")

# (layer name, module prefixes): the first matching prefix names a module's layer; longer prefixes first
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("types", ("rollout_service.api", "rollout_service.config", "rollout_service.prompts",
               "rollout_service.token_prefixes",
               "rollout_service.examples.sample_prompts", "rollout_service.user_code", "rollout_service.results.file", "rollout_service.results.__init__",
               "rollout_service.fidelity", "rollout_service.examples.tasks", "rollout_service.examples.__init__",
               "rollout_service.rewards.functions", "rollout_service.rewards.__init__", "rollout_service.episodes", "rollout_service.results.receipts",
               "rollout_service.score_requests", "rollout_service.results.payloads")),
    ("ops", ("rollout_service.ops",)),
    ("model", ("rollout_service.model",)),
    ("weights", ("rollout_service.weights",)),
    ("engine", ("rollout_service.engine",)),
    ("host", ("rollout_service.rewards.runner", "rollout_service.rewards.examples", "rollout_service.examples.calculator_env",
              "rollout_service.host")),
    ("cluster", ("rollout_service.connections.capacity", "rollout_service.connections.remote_errors",
                 "rollout_service.connections.ray_cluster", "rollout_service.connections.ray_auth")),
    ("actors", ("actors",)),
    ("connections", ("rollout_service.connections", "rollout_service.results.stream",
                     "rollout_service.results.sharded_stream")),
    ("client", ("rollout_service.client", "rollout_service.dynamic_sampling", "rollout_service.openai")),
    ("training", ("rollout_service.training", "actors.learner", "actors.grpo",
                  "actors.grpo_config",
                  "rollout_service.__init__")),
    ("entry", ("rollout_service.launch", "rollout_service.cli")),
    ("benchmarks", ("benchmarks",)),
]


@dataclass
class Module:
    name: str
    path: Path
    lines: int
    imports: set[str] = field(default_factory=set)  # project modules it imports (any import statement)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1] + ["__init__"]
    return ".".join(parts)


def layer_of(name: str, strict: bool = True) -> tuple[int, str]:
    """(rank, name) of a module's layer; a module in none is a KeyError, or (-1, "?") when not `strict` (for
    reading another commit's tree)."""
    best = None
    for rank, (layer, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > best[2]):
                best = (rank, layer, len(p))
    if best is None:
        if not strict:
            return -1, "?"
        raise KeyError(f"module {name} belongs to no layer: add it to tests/layering.py LAYERS")
    return best[0], best[1]


def _targets(node: ast.AST, here: str, known: set[str]) -> set[str]:
    """Project modules named by one import statement (a `from pkg import mod` names the module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level:  # (the project has no relative imports: a test checks)
        base = node.module or ""
        # `from pkg import mod` depends on the module; `from mod import name`, on mod
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    else:
        return set()
    out = set()
    for n in names:
        while n and n not in known and n + ".__init__" not in known:
            n = n.rpartition(".")[0]
        if n:
            out.add(n if n in known else n + ".__init__")
    return out


def scan(root: Path = ROOT) -> dict[str, Module]:
    files = [p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))]
    mods = {module_name(p, root): Module(module_name(p, root), p, len(p.read_text().splitlines())) for p in files}
    known = set(mods)
    for m in mods.values():
        for node in ast.walk(ast.parse(m.path.read_text(), str(m.path))):
            m.imports |= _targets(node, m.name, known) - {m.name}
    return mods


def folder(name: str) -> str:
    return name.rpartition(".")[0]


def circles(mods: dict[str, Module], across_folders: bool = True) -> list[list[str]]:
    """Import circles (strongly connected components of more than one file); with `across_folders`, only those
    that cross a folder (one inside a folder is that package's own business)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in mods[v].imports:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 and (not across_folders or len({folder(c) for c in comp}) > 1):
                out.append(sorted(comp))

    for v in mods:
        if v not in index:
            visit(v)
    return out


def upward(mods: dict[str, Module], strict: bool = True) -> list[tuple[str, str, str, str]]:
    """(importer, its layer, imported, its layer) for every import of a higher layer."""
    bad = []
    for m in mods.values():
        rank, layer = layer_of(m.name, strict)
        for t in sorted(m.imports):
            trank, tlayer = layer_of(t, strict)
            if rank < 0 or trank < 0:  # (a module of another tree that no layer names: not judged)
                continue
            if trank > rank:
                bad.append((m.name, layer, t, tlayer))
    return bad


def import_time_imports(mod: Module, known: set[str]) -> set[str]:
    """The project modules `mod` imports when it is itself imported: statements outside function bodies (a
    class body runs at import time, a method's does not)."""
    out: set[str] = set()

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            out.update(_targets(child, mod.name, known))
            walk(child)

    walk(ast.parse(mod.path.read_text(), str(mod.path)))
    return out - {mod.name}
