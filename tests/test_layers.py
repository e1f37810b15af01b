"""The module structure (tests/layering.py, docs/layout.md): every file in a layer, no import up a layer, no
import circle across or inside folders, no file over 400 lines."""
from layering import ROOT, circles, import_time_imports, layer_of, scan, upward

MAX_LINES = 400


def test_every_module_imports_only_its_layer_and_below():
    mods = scan()
    for name in mods:
        layer_of(name)  # KeyError naming a module that belongs to no layer
    assert upward(mods) == [], "imports up a layer: (importer, its layer, imported, its layer)"


def test_no_import_circles_across_or_inside_folders():
    assert circles(scan(), across_folders=False) == []


def test_no_relative_imports():
    """The scan reads absolute imports only, so a relative one would hide an edge (it hid a circle in the harness)."""
    import ast
    relative = [f"{m.path.relative_to(ROOT)}:{node.lineno}" for m in scan().values()
                for node in ast.walk(ast.parse(m.path.read_text())) if isinstance(node, ast.ImportFrom) and node.level]
    assert relative == []


def test_no_python_file_over_400_lines():
    files = [p for d in ("rollout_service", "actors", "benchmarks", "tests", "scripts") for p in (ROOT / d).rglob("*.py")]
    big = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}


def test_the_scan_sees_an_upward_import_and_a_circle():
    """The checks can fail: a types-layer module importing the client, and two files importing each other."""
    mods = scan()
    mods["rollout_service.api.types"].imports.add("rollout_service.client")
    assert ("rollout_service.api.types", "types", "rollout_service.client", "client") in upward(mods)
    mods["rollout_service.client"].imports.add("actors.router")
    mods["actors.router"].imports.add("rollout_service.client")
    assert any({"actors.router", "rollout_service.client"} <= set(c) for c in circles(mods))


def _actors_imported_at_import_time(mods) -> dict[str, list[str]]:
    known = set(mods)
    found = {m.name: sorted(t for t in import_time_imports(m, known) if t.split(".")[0] == "actors")
             for m in mods.values() if m.name.startswith("rollout_service.")}
    return {k: v for k, v in found.items() if v}


def test_rollout_service_never_imports_actors_when_imported():
    """actors/ depends on rollout_service, not the reverse: the only way in is the Ray connection starting the
    router, inside the function that starts it."""
    mods = scan()
    assert _actors_imported_at_import_time(mods) == {}
    lazy = {m.name for m in mods.values() if m.name.startswith("rollout_service.")
            and any(t.split(".")[0] == "actors" for t in m.imports)}
    assert lazy == {"rollout_service.connections.ray"}


def test_the_import_time_scan_sees_a_top_level_import(tmp_path):
    """It can fail: a module-level `from actors.router import X` is seen, the same line in a function is not."""
    from layering import Module
    mods = scan()
    src = tmp_path / "m.py"
    src.write_text("import os\nfrom actors.router import RouterActor\n\ndef f():\n    from actors.control import x\n")
    mods["rollout_service.fake"] = Module("rollout_service.fake", src, 5)
    assert _actors_imported_at_import_time(mods) == {"rollout_service.fake": ["actors.router"]}


def test_the_router_reads_a_refresh_payload_without_importing_torch():
    """A router process passes every refresh on to its workers, so it unpickles the payload's manifest and delta
    plan (weights/manifest.py): neither they nor the router's modules may import torch (~1.5 s of CPU and ~180 MB
    resident in every router process)."""
    import pickle
    import subprocess
    import sys

    import torch

    from rollout_service.weights.buckets import Buckets, plan
    from rollout_service.weights.delta import encode
    from rollout_service.weights.manifest import GroupSpec

    old = {"a": torch.zeros(300), "b": torch.ones(4, 4)}
    manifest = plan(list(old.items()))
    base = Buckets(manifest)
    base.fill(list(old.items()))
    new = [("a", torch.zeros(300).index_fill_(0, torch.tensor([7]), 1.0)), ("b", torch.ones(4, 4))]
    delta, _ = encode(manifest, new, base, base_version=1)
    assert any(b.sparse for b in delta.buckets)  # a real sparse plan, not only dense buckets
    group = GroupSpec("g", "127.0.0.1", 29500, 3, "gloo", 60.0)  # a broadcast's weight group, formed through it
    code = ("import pickle, sys; import actors.router; p = pickle.loads(sys.stdin.buffer.read()); "
            "assert p['delta'].wire_manifest().nbytes > 0 and p['manifest'].names() == ['a', 'b']; "
            "assert p['group'].world_size == 3; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    payload = pickle.dumps({"manifest": manifest, "delta": delta, "group": group})
    proc = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout.decode().strip() == "[]"
