"""The module structure as text: per file its layer, lines and the project modules it imports; then the import
circles across folders and the imports up a layer (tests/layering.py holds the rules; tests/test_layers.py
asserts there are none).

    python scripts/import_graph.py [ROOT]   # ROOT: another checkout (another commit's tree) to read instead
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from layering import LAYERS, circles, layer_of, scan, upward  # noqa: E402


def main() -> None:
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else None
    strict = root is None
    mods = scan(root) if root else scan()
    print("layers, bottom to top: " + " < ".join(name for name, _ in LAYERS))
    print(f"{len(mods)} files, {sum(m.lines for m in mods.values())} lines\n")
    for name in sorted(mods, key=lambda n: (layer_of(n, strict)[0], n)):
        m = mods[name]
        print(f"[{layer_of(name, strict)[1]:8s}] {name} ({m.lines} lines)")
        for t in sorted(m.imports):
            print(f"             -> {t}")
    print("\nimport circles across folders:")
    for c in circles(mods):
        print("  " + " <-> ".join(c))
    print("\nimport circles inside one folder:")
    for c in circles(mods, across_folders=False):
        if len({n.rpartition(".")[0] for n in c}) == 1:
            print("  " + " <-> ".join(c))
    print("\nimports up a layer:")
    for importer, layer, imported, its in upward(mods, strict):
        print(f"  {importer} ({layer}) -> {imported} ({its})")
    big = [(m.lines, n) for n, m in mods.items() if m.lines > 400]
    print("\nfiles over 400 lines: " + (", ".join(f"{n} ({k})" for k, n in sorted(big, reverse=True)) or "none"))


if __name__ == "__main__":
    main()
