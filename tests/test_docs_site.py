"""The documentation site (docs/, mkdocs.yml) builds with `mkdocs build --strict`: a page missing from the nav, a
broken link or a link to a missing heading fails the suite."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build(root: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                           "-d", str(out)], capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})


def test_the_docs_build_strictly(tmp_path):
    proc = build(REPO, tmp_path / "site")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "learner-api" / "index.html").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    proc = build(tmp_path, tmp_path / "site")
    assert proc.returncode != 0 and "no-such-page.md" in proc.stdout + proc.stderr


def test_the_results_page_shows_the_committed_results():
    """docs/benchmark-results.md is generated from benchmarks/results/*.json: a result file lands with its page."""
    from benchmarks.harness import summary

    assert summary.PAGE.read_text() == summary.page(), "run: python -m benchmarks.harness.summary"
    assert summary.page().count("\n| ") >= 20  # a row per (hardware, model, workload) measured
