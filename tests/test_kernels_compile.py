"""CI guard for csrc: every kernel compiles with plain nvcc for sm_90a and sm_80, and no hot kernel spills."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOT_KERNELS = ("decode_kernel", "decode_reduce_kernel", "gemv_kernel", "prefill_kernel", "rope_kv_kernel", "rms_norm_kernel")
LINE = re.compile(r"^(sm_\w+)\s+regs=(\d+)\s+smem=(\d+)\s+stack=(\d+)\s+spill_st=(\d+)\s+spill_ld=(\d+)\s+(.+)$")

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@pytest.fixture(scope="module")
def report() -> list[tuple]:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "compile_kernels.sh")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"kernel compile failed:\n{proc.stdout}\n{proc.stderr}"
    rows = [m.groups() for line in proc.stdout.splitlines() if (m := LINE.match(line.strip()))]
    assert rows, f"no ptxas report parsed from:\n{proc.stdout}"
    return rows


def test_every_hot_kernel_compiles_for_both_archs(report):
    for kernel in HOT_KERNELS:
        for arch in ("sm_90a", "sm_80"):
            hits = [r for r in report if r[0] == arch and re.search(rf"\b{kernel}<", r[6])]
            assert hits, f"{kernel} missing from the {arch} build"


def test_no_spills_or_stack_in_hot_kernels(report):
    bad = [
        f"{arch} {name}: stack={stack} spill_st={st} spill_ld={ld}"
        for arch, _, _, stack, st, ld, name in report
        if any(k in name for k in HOT_KERNELS) and (int(st) or int(ld) or int(stack))
    ]
    assert not bad, "register spills / local memory in hot kernels:\n" + "\n".join(bad)
