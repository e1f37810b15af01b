"""The commands the docs tell a user to type: every `ray start` in the README, docs/ and the cluster configs turns Ray's
usage-stats reporting off (left on, a node's dashboard tries to reach the internet)."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ray_start_commands() -> list[tuple[str, str]]:
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
                 *sorted((REPO / "cluster_configs").glob("*.yaml"))]:
        for line in path.read_text().splitlines():
            # a command: the line (after a comment or list marker and env assignments) starts with it
            if re.match(r"^\s*(#\s*)?(-\s*)?([A-Z_]+=\S+\s+)*ray start\b", line):
                found.append((path.name, line.strip()))
    return found


def test_every_documented_ray_start_turns_usage_stats_off():
    commands = ray_start_commands()
    assert len(commands) >= 5, commands  # README recipe, multi-node.yaml (2), ray-cluster.yaml (2)
    missing = [c for c in commands if "--disable-usage-stats" not in c[1]]
    assert not missing, missing
