"""Result rows and the report: JSON plus a markdown table, one row per (model, workload).

Ratios are performance ratios, engine over peer: for a rate (tokens/s) engine/peer, for a time
(ms/step, µs, s) peer/engine — so > 1 always means the engine is faster. The floor fraction is the
engine's performance over the floor's (<= 1 up to measurement noise).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from benchmarks.harness.result_files import harness_unit, harness_workload, save_newest

PEERS = ("hf_generate", "hf_generate_batch", "other_peer")
PEER_TITLES = {"hf_generate": "HF generate", "hf_generate_batch": "HF generate_batch", "other_peer": "other peer"}


@dataclass
class Cell:
    value: float | None = None
    note: str = ""           # why value is None, or what the value is (e.g. the other peer's name)

    @classmethod
    def na(cls, why: str) -> "Cell":
        return cls(None, why)


@dataclass
class Row:
    model: str
    workload: str
    metric: str
    unit: str
    higher_is_better: bool
    engine: Cell = field(default_factory=lambda: Cell.na("not run"))
    hf_generate: Cell = field(default_factory=lambda: Cell.na("not run"))
    hf_generate_batch: Cell = field(default_factory=lambda: Cell.na("not run"))
    other_peer: Cell = field(default_factory=lambda: Cell.na("none for this workload"))
    floor: Cell = field(default_factory=lambda: Cell.na("not computed"))
    details: dict = field(default_factory=dict)

    def perf_ratio(self, other: Cell) -> float | None:
        """Engine performance / other's performance (> 1 = engine faster)."""
        a, b = self.engine.value, other.value
        if a is None or b is None or a <= 0 or b <= 0:
            return None
        return a / b if self.higher_is_better else b / a

    def relabel(self, base: str, name: str, condition: str) -> None:
        """This row as a variant of workload `base` run under `condition` (W1 -> W1fp8, "W6 overhead" ->
        "W6fp8 overhead"): the variant's name, the condition in front of the metric."""
        self.workload = self.workload.replace(base, name, 1)
        self.metric = f"{condition}: {self.metric}"

    @classmethod
    def from_dict(cls, d: dict) -> "Row":
        """A row as to_dict wrote it (its ratios are computed again from the cells)."""
        cells = {k: Cell(**d[k]) for k in ("engine", *PEERS, "floor") if k in d}
        return cls(d["model"], d["workload"], d["metric"], d["unit"], d["higher_is_better"], **cells,
                   details=d.get("details", {}))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratios"] = {f"engine/{p}": self.perf_ratio(getattr(self, p)) for p in PEERS}
        d["ratios"]["engine/floor"] = self.perf_ratio(self.floor)
        return d


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def _fmt_ratio(r: float | None, suffix: str = "x") -> str:
    if r is None:
        return "n/a"
    return f"{r:.2f}{suffix}" if r >= 0.1 else f"{r:.2g}{suffix}"


def render_markdown(meta: dict, ceilings: dict | None, rows: list[Row]) -> str:
    lines = [f"# Benchmark {meta['started_utc']} on {meta['hardware']}", ""]
    lines.append(f"torch {meta['torch']}, transformers {meta['transformers']}, python {meta['python']}; "
                 f"device {meta['device']}; engine backend {meta.get('engine_backend', '?')}; "
                 f"command `{meta['command']}`")
    if meta.get("loadavg"):
        lines.append(f"Load average (1 min) at start {meta['loadavg']['start'][0]:.2f}, "
                     f"at end {meta['loadavg'].get('end', [float('nan')])[0]:.2f} on {meta['cpu_count']} CPUs; "
                     f"torch threads {meta.get('torch_threads', '?')}.")
    if ceilings:
        read = f", read-only {ceilings['read_Bps'] / 1e9:.1f} GB/s" if ceilings.get("read_Bps") else ""
        lines.append(f"Ceilings: copy {ceilings['bandwidth_Bps'] / 1e9:.1f} GB/s "
                     f"({ceilings['copy_bytes'] >> 20} MiB, read + write){read}, matmul "
                     f"{ceilings['matmul_flops'] / 1e12:.3g} TFLOP/s ({ceilings['matmul_dtype']} "
                     f"{ceilings['matmul_n']}^3).")
    lines += ["", "Ratios are engine performance / peer performance (> 1: engine faster; for times, peer "
              "time / engine time). engine/floor is the fraction of the hardware floor reached.", ""]
    head = ["model", "workload", "metric", "engine", "HF generate", "HF generate_batch", "other peer",
            "floor", "engine/generate", "engine/generate_batch", "engine/other", "engine/floor"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        other = _fmt(r.other_peer.value)
        if r.other_peer.value is not None and r.other_peer.note:
            other += f" ({r.other_peer.note})"
        cells = [r.model, r.workload, f"{r.metric} [{r.unit}]", _fmt(r.engine.value), _fmt(r.hf_generate.value),
                 _fmt(r.hf_generate_batch.value), other, _fmt(r.floor.value),
                 *(_fmt_ratio(r.perf_ratio(getattr(r, p))) for p in PEERS),
                 _fmt_ratio(r.perf_ratio(r.floor), "")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Notes", ""]
    for r in rows:
        # One line per row: each n/a reason once, with the columns it applies to.
        why: dict[str, list[str]] = {}
        for n in ("engine", *PEERS, "floor"):
            c = getattr(r, n)
            if c.value is None and c.note:
                why.setdefault(c.note, []).append(n)
        notes = [f"{'/'.join(cols)} n/a: {note}" for note, cols in why.items()]
        extra = [f"{k}={v}" for k, v in r.details.items()]
        if notes or extra:
            lines.append(f"- {r.model} {r.workload}: " + "; ".join(notes + extra))
    return "\n".join(lines) + "\n"


def render_run(run: dict) -> str:
    """One run of a result file ({"meta", "ceilings", "rows"} as written) as render_markdown gives it."""
    return render_markdown(run["meta"], run.get("ceilings"), [Row.from_dict(r) for r in run["rows"]])


def write_report(out_dir: str, meta: dict, ceilings: dict | None, rows: list[Row]) -> list[str]:
    """Write each workload's rows to <date>-<hardware>-<workload>.json and .md in out_dir, replacing the older
    file of the same hardware and workload (result_files.save_newest); called after every workload so a run cut
    short still leaves everything measured so far. Returns the JSON paths."""
    by_workload: dict[str, list[dict]] = {}
    for r in rows:
        d = r.to_dict()
        by_workload.setdefault(harness_workload(d), []).append(d)
    return [save_newest(out_dir, wl, {"meta": meta, "ceilings": ceilings, "rows": wl_rows}, harness_unit, render_run)
            for wl, wl_rows in by_workload.items()]


def now_utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
