"""Fidelity reports: how closely a learner's log-probs match the rollouts of a policy version, as the learner
tells the service (RolloutClient.report_fidelity). A report is a few summary numbers; the checks and bounds
here are the same in-process and in the router, and `FidelityLog` is what either keeps of them.
"""
from __future__ import annotations

import logging
import reprlib
from collections import deque
from collections.abc import Mapping
from typing import Any, Callable

from rollout_service.api.checks import check_text
from rollout_service.api.values import MAX_INT32, is_int, is_number

FIDELITY_KEPT = 256  # fidelity reports a service keeps (the newest)
# What one report may hold. The service keeps FIDELITY_KEPT of them and returns them all with every info(),
# so these bound its memory and info()'s cost (a few numbers is what a report is for).
FIDELITY_MAX_KEYS = 32
FIDELITY_MAX_VALUES = 256  # numbers, strings and None in all, each item of a list counted
FIDELITY_MAX_STR = 128     # characters of a key or a string value
FIDELITY_LINE_MAX = 400    # characters of the log line of one report
_WHY_BOUNDED = (f"the service keeps the last {FIDELITY_KEPT} reports and returns them with every info(): "
                "report summary numbers, not per-token data")
_SHORT = reprlib.Repr()
_SHORT.maxlist, _SHORT.maxstring, _SHORT.maxother = 6, 40, 40


def _json_scalar(v: Any) -> Any:
    """v as a plain JSON value (numpy scalars become Python numbers), or ValueError saying what it is."""
    if v is None:
        return v
    if isinstance(v, str):
        check_text(v, "a string")
        if len(v) > FIDELITY_MAX_STR:
            raise ValueError(f"a string of {len(v)} characters (at most {FIDELITY_MAX_STR}: {_WHY_BOUNDED})")
        return v
    if is_int(v):
        if not -2**63 <= v < 2**63:
            raise ValueError("an int outside [-2**63, 2**63)")
        return int(v)
    if is_number(v):
        return float(v)
    raise ValueError(f"a {type(v).__name__}; values are numbers, strings, None or lists of those")


def check_fidelity(version: Any, report: Any) -> dict:
    """A fidelity report as the service keeps it: {"version": version, **report}, every value a plain JSON
    number, string, None or list of those, within the FIDELITY_MAX_* bounds. ValueError naming what is wrong
    (checked before anything is copied: an oversized report costs little to refuse)."""
    if not is_int(version) or not 0 <= version <= MAX_INT32:
        raise ValueError(f"report_fidelity: version={version!r} must be an int >= 0 (and < 2**31)")
    if not isinstance(report, Mapping):
        raise ValueError(f"report_fidelity: report must be a dict, got {type(report).__name__}")
    if len(report) > FIDELITY_MAX_KEYS:
        raise ValueError(f"report_fidelity: report has {len(report)} keys, at most {FIDELITY_MAX_KEYS} "
                         f"({_WHY_BOUNDED})")
    entry: dict = {"version": int(version)}
    values = 0
    for k, v in report.items():
        if not isinstance(k, str) or k == "version":
            raise ValueError(f"report_fidelity: report key {_SHORT.repr(k)}: keys are strings other than 'version' "
                             "(the version is its own argument)")
        try:
            _json_scalar(k)
        except ValueError as e:
            raise ValueError(f"report_fidelity: report key {_SHORT.repr(k)} is {e}") from None
        values += len(v) if isinstance(v, (list, tuple)) else 1
        if values > FIDELITY_MAX_VALUES:
            raise ValueError(f"report_fidelity: report[{_SHORT.repr(k)}] takes the report past "
                             f"{FIDELITY_MAX_VALUES} values (list items counted; {_WHY_BOUNDED})")
        try:
            entry[k] = [_json_scalar(x) for x in v] if isinstance(v, (list, tuple)) else _json_scalar(v)
        except ValueError as e:
            raise ValueError(f"report_fidelity: report[{_SHORT.repr(k)}] holds {e}") from None
    return entry


def fidelity_line(entry: dict) -> str:
    """One log line of at most FIDELITY_LINE_MAX characters: "fidelity of version 3: mean |dlogp| 1.2e-04,
    max 3.1e-02, KL 2e-06, max ratio 1.03 over 4096 tokens" from the keys of
    rollout_service.training.mismatch.logprob_mismatch (a report with none of them is written as key=value, long
    values abridged)."""
    known = {"mean_abs": "mean |dlogp| {:.1e}", "max_abs": "max {:.1e}", "kl": "KL {:.0e}",
             "ratio_max": "max ratio {:.3g}", "ratio_outside_share": "{:.2%} of tokens outside the ratio band"}
    parts = [fmt.format(entry[k]) for k, fmt in known.items() if isinstance(entry.get(k), (int, float))]
    parts = parts or [f"{k}={_SHORT.repr(v)}" for k, v in entry.items() if k not in ("version", "n_tokens")]
    tokens = f" over {entry['n_tokens']} tokens" if entry.get("n_tokens") is not None else ""
    line = f"fidelity of version {entry['version']}: {', '.join(parts) or 'no measurements'}{tokens}"
    return line if len(line) <= FIDELITY_LINE_MAX else line[:FIDELITY_LINE_MAX - 3] + "..."


class FidelityLog:
    """The newest FIDELITY_KEPT reports, each checked, kept and written as one log line."""

    def __init__(self, log: Callable[[str], None] | None = None):
        self._entries: deque[dict] = deque(maxlen=FIDELITY_KEPT)
        self._log = log or logging.getLogger(__name__).info

    def report(self, version: Any, report: Any) -> None:
        """ValueError naming what is wrong (nothing is kept then)."""
        entry = check_fidelity(version, report)
        self._entries.append(entry)
        self._log(fidelity_line(entry))

    def entries(self) -> list[dict]:
        """Copies, oldest first."""
        return [dict(e) for e in self._entries]
