"""WO: what the OpenAI endpoint (rollout_service/openai) costs over the Python client, in one run on one box.

One in-process engine (local mode) serves both paths, so the engine's own time is the same in each:
- latency: the same chat call (the embedded model's chat template, greedy, a few new tokens) as
  `client.generate` on its rendered token ids and on its messages (rendered by the client, like for like), and
  through the endpoint over HTTP (uvicorn on 127.0.0.1) with a bare httpx client and with the official `openai`
  package, interleaved call by call; "added" is the median of each call's difference from the token-ids call next
  to it, so that the machine's drift cancels; "outside the engine" is each call's time less its engine's own
  (its result's timings), so that the engine's run, which varies by several ms from call to call, cancels too;
- streaming: a longer answer (`--stream-tokens` greedy tokens) with the `openai` package, whole and streamed,
  interleaved: the streamed call's time to its first text and to its end against the whole call's;
- sessions: `--sessions` sessions, each one call with its own session id, from `--threads` client threads,
  all held at once: the process's resident memory before, with all of them held, and after `release`.

  python -m benchmarks.harness.openai_bench [--calls 100] [--sessions 1000] [--quick]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

MESSAGES = [{"role": "user", "content": "What is 17 + 25? Answer with the number."}]
TOKEN = "openai-bench-token"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1000, out


def _quantile(xs: list[float], q: float) -> float:
    return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 2)


class EngineClock:
    """The engine's own time of the call just made (its result's timings: submitted to finished), whichever path made
    it: the Python paths hand it their results, the endpoint's calls are read through `wrap`, the client the app
    holds. A call's time outside the engine is its wall time less this: the engine's run, whose length varies by
    several ms from call to call on a busy box, cancels out of it."""

    def __init__(self) -> None:
        self.last: float | None = None

    def note(self, results: list) -> list:
        t = results[-1].timings
        self.last = (t["finished"] - t["queued"]) * 1000
        return results

    def take(self) -> float | None:
        last, self.last = self.last, None
        return last

    def wrap(self, client: Any) -> Any:
        clock = self

        class Clocked:
            def __getattr__(self, name: str) -> Any:
                return getattr(client, name)

            def stream(self, *args: Any, **kwargs: Any) -> Any:
                return clock._read(client.stream(*args, **kwargs))  # submitted now, as the client's own stream
        return Clocked()

    def _read(self, it: Any) -> Any:
        for r in it:
            if hasattr(r, "timings"):
                self.note([r])
            yield r


def measure_latency(client: Any, server: Any, calls: int, max_tokens: int) -> list[dict]:
    import httpx
    from openai import OpenAI

    from rollout_service import SamplingParams
    svc = server.app.state.runtime.svc
    clock = EngineClock()
    svc.client = clock.wrap(svc.client)
    ids = svc.renderer.render(MESSAGES)  # what the endpoint sends the service
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    body = {"model": "m", "messages": MESSAGES, "temperature": 0.0, "max_tokens": max_tokens}
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    sdk = OpenAI(base_url=server.url, api_key=TOKEN, max_retries=0, timeout=60)
    paths: dict[str, Callable[[], list[int]]] = {
        "python client, token ids": lambda: clock.note(client.generate([ids], sp, apply_chat_template=False))[0]
        .token_ids,
        "python client, messages": lambda: clock.note(client.generate([MESSAGES], sp))[0].token_ids,
        "HTTP, httpx": lambda: http.post("/chat/completions", json=body).raise_for_status().json()
        ["choices"][0]["token_ids"],
        "HTTP, openai package": lambda: sdk.chat.completions.create(
            model="m", messages=MESSAGES, temperature=0.0, max_tokens=max_tokens).choices[0].model_extra["token_ids"],
    }
    try:
        return interleaved(paths, calls, clock.take)
    finally:
        http.close()
        svc.client = client


def interleaved(paths: dict[str, Callable[[], list[int]]], calls: int,
                engine_ms: Callable[[], float | None] = lambda: None) -> list[dict]:
    """Each path's call timed `calls` times, the paths in turn; "added": the median of each call's difference from
    the first path's call next to it (the machine's drift cancels); "same_tokens": its tokens are the first's.
    `engine_ms()`: the engine's time of the call just made, if known: then "outside_ms" is the median of each call's
    time less its engine's, and "added_outside_ms" that median less the first path's (for each path whose every
    call's engine time is known, the first path's included)."""
    times: dict[str, list[float]] = {p: [] for p in paths}
    outside: dict[str, list[float]] = {p: [] for p in paths}
    tokens: dict[str, list[int]] = {}
    for i in range(calls + 5):  # the first 5 rounds warm every path up
        for name, call in paths.items():
            ms, tokens[name] = _timed(call)
            engine = engine_ms()
            if i >= 5:
                times[name].append(ms)
                if engine is not None:
                    outside[name].append(ms - engine)
    first = next(iter(paths))
    rows = [{"measure": "latency", "path": name, "calls": len(ts), "median_ms": round(statistics.median(ts), 2),
             "p10_ms": _quantile(ts, 0.1), "p90_ms": _quantile(ts, 0.9),
             "added_median_ms": round(statistics.median([t - b for t, b in zip(ts, times[first])]), 2),
             "same_tokens": tokens[name] == tokens[first]} for name, ts in times.items()]
    if len(outside[first]) == calls:  # (a path whose engine time is not known here has no such figure)
        base = statistics.median(outside[first])
        for row in rows:
            if len(outside[row["path"]]) == calls:
                row["outside_ms"] = round(statistics.median(outside[row["path"]]), 2)
                row["added_outside_ms"] = round(row["outside_ms"] - base, 2) + 0.0  # (no "-0.0")
    return rows


def measure_streaming(server: Any, calls: int, max_tokens: int) -> dict:
    """The same greedy chat call whole and streamed (the `openai` package), interleaved: when the streamed one
    shows its first text and ends, against the whole one's end; and whether its chunks add up to the whole text."""
    from openai import OpenAI

    sdk = OpenAI(base_url=server.url, api_key=TOKEN, max_retries=0, timeout=120)
    kw = {"model": "m", "messages": MESSAGES, "temperature": 0.0, "max_tokens": max_tokens}

    def streamed() -> tuple[float, str, int]:
        t0, first, pieces = time.perf_counter(), None, []
        for chunk in sdk.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                if c.delta.content:
                    first = first if first is not None else (time.perf_counter() - t0) * 1000
                    pieces.append(c.delta.content)
        return first, "".join(pieces), len(pieces)

    whole, first, done, same, chunks = [], [], [], True, 0
    for i in range(calls + 2):  # two warm-up rounds
        ms, out = _timed(lambda: sdk.chat.completions.create(**kw).choices[0].message.content)
        end_ms, (first_ms, text, n) = _timed(streamed)
        if i >= 2:
            whole.append(ms)
            first.append(first_ms)
            done.append(end_ms)
            same, chunks = same and text == out, max(chunks, n)
    return {"measure": "streaming", "calls": calls, "max_tokens": max_tokens,
            "whole_median_ms": round(statistics.median(whole), 2),
            "first_text_median_ms": round(statistics.median(first), 2),
            "stream_end_median_ms": round(statistics.median(done), 2), "text_chunks": chunks, "same_text": same}


def measure_history(renderer: Any, turns: tuple[int, ...] = (11, 21, 41), sessions: int = 5) -> dict:
    """`sessions` agents' chat histories, each growing by a turn a call (a few hundred tokens a turn) and rendered
    whole each call as the endpoint renders it (a renderer of its own, which keeps the ids of text it rendered
    before: rollout_service/token_prefixes.py) and through the tokenizer's apply_chat_template: per length in
    `turns` (odd: a user's turn ends the history), the median over the sessions of that call's ms; same ids
    required."""
    from rollout_service.openai.templates import ChatRenderer

    para = "Step {i}: the function sums the first n integers, then checks 17 + 25 = 42 against it. " * 12
    ms: dict[int, list[float]] = {t: [] for t in turns}
    whole: dict[int, list[float]] = {t: [] for t in turns}
    tokens, same = {}, True
    for k in range(sessions):
        ours = ChatRenderer(renderer.tokenizer, renderer.prompts.vocab_size, renderer.eos_ids)
        history = []
        for turn in range(1, max(turns) + 1):
            history.append({"role": "user" if turn % 2 else "assistant", "content": para.format(i=f"{k}.{turn}")})
            if turn % 2 == 0:
                continue
            t, ids = _timed(lambda: ours.render(history))
            if turn in ms:
                w, want = _timed(lambda: renderer.tokenizer.apply_chat_template(history, add_generation_prompt=True,
                                                                                tokenize=True))
                same = same and ids == list(want["input_ids"] if hasattr(want, "keys") else want)
                ms[turn].append(t)
                whole[turn].append(w)
                tokens[turn] = len(ids)
    rows = [{"turns": t, "tokens": tokens[t], "ms": round(statistics.median(ms[t]), 2),
             "whole_ms": round(statistics.median(whole[t]), 2)} for t in turns]
    return {"measure": "history", "sessions": sessions, "rows": rows, "same_ids": same}


def measure_sessions(server: Any, sessions: int, threads: int, max_tokens: int, rounds: int = 4) -> dict:
    """`rounds` rounds of `sessions` sessions, each round held at once and then released: resident memory with
    each round held and after it (bounded: flat over the second half of the rounds, once the allocator's
    per-thread arenas have grown), and the Python heap the held sessions take in the first round
    (tracemalloc: what the endpoint's session store and its callers keep, not the engine)."""
    import tracemalloc

    import httpx

    from rollout_service.engine.heap import release_freed_memory
    from rollout_service.openai import release

    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120,
                        limits=httpx.Limits(max_connections=threads))

    def call(sid: str) -> int:
        body = {"model": "m", "messages": MESSAGES, "temperature": 1.0, "seed": hash(sid) % 1000,
                "max_tokens": max_tokens, "session_id": sid}
        return len(http.post("/chat/completions", json=body).raise_for_status().json()["choices"][0]["token_ids"])

    def settled() -> float:
        gc.collect()
        release_freed_memory()
        return _rss_mib()

    rss = [settled()]
    held_py, held, released, sampled, wall = 0, [], 0, 0, 0.0
    for k in range(rounds):
        ids = [f"bench-session-{k}-{i}" for i in range(sessions)]
        if k == 0:  # the heap per session, from the first round alone: tracemalloc's own records take memory
            tracemalloc.start()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            sampled += sum(pool.map(call, ids))
        wall += time.perf_counter() - t0
        held.append(len(server.app.state.sessions))
        gc.collect()
        if k == 0:
            held_py = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
        rss.append(_rss_mib())
        released += release(server.app, ids)
        rss.append(settled())
    http.close()
    holding = rss[1::2]
    return {"measure": "sessions", "sessions": sessions, "rounds": rounds, "threads": threads, "held": min(held),
            "released": released, "tokens": sampled, "wall_s": round(wall, 1),
            "calls_per_s": round(rounds * sessions / wall, 1), "rss_mib": [round(r, 1) for r in rss],
            "rss_growth_after_round_2_mib": round(max(holding[2:] or holding[-1:]) - holding[min(1, len(holding) - 1)], 1),
            "rss_held_band_mib": round(max(holding[len(holding) // 2:]) - min(holding[len(holding) // 2:]), 1),
            "python_kib_per_session": round(held_py / 1024 / sessions, 2)}


def main(argv: list[str] | None = None) -> int:
    from rollout_service import RolloutClient
    from rollout_service.openai import serve_openai

    from benchmarks.harness.result_files import results_dir
    from benchmarks.harness.service_bench import write_results
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--calls", type=int, default=100, help="timed calls per path")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=64, help="greedy tokens of the streaming part's answer")
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--threads", type=int, default=16, help="client threads of the sessions part")
    p.add_argument("--rounds", type=int, default=8, help="rounds of the sessions part")
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="", help="a label of the run, kept in its meta")
    p.add_argument("--quick", action="store_true", help="tiny counts: a smoke run")
    args = p.parse_args(argv)
    calls, sessions = (3, 20) if args.quick else (args.calls, args.sessions)
    client = RolloutClient.local(args.model, device="cpu", dtype="float32")
    server = serve_openai(client, port=0, block=False, token=TOKEN)
    try:
        rows = measure_latency(client, server, calls, args.max_tokens)
        rows.append(measure_streaming(server, max(3, calls // 5), args.stream_tokens))
        rows.append(measure_sessions(server, sessions, args.threads, args.max_tokens, args.rounds))
        rows.append(measure_history(server.app.state.runtime.svc.renderer, (3, 5) if args.quick else (11, 21, 41)))
    finally:
        server.stop()
        client.close()
    meta = {"model": args.model, "device": "cpu", "max_tokens": args.max_tokens, "messages": MESSAGES}
    for r in rows:
        print(r)
    write_results(results_dir(args.out, args.quick), "openai-endpoint", meta, rows, markdown, args.tag)
    return 0 if all(r.get("same_tokens", True) and r.get("same_text", True) and r.get("same_ids", True)
                    for r in rows) else 1


def latency_table(rows: list[dict]) -> list[str]:
    """The latency rows (interleaved()'s) as a markdown table (with the times outside the engine where measured)."""
    rows = [r for r in rows if r["measure"] == "latency"]
    clocked = any("outside_ms" in r for r in rows)
    extra = (" outside the engine ms (median) | added outside the engine ms |", "---|---|") if clocked else ("", "")
    return [f"| path | calls | median ms | p10 ms | p90 ms | added ms (median) |{extra[0]} same tokens |",
            f"|---|---|---|---|---|---|{extra[1]}---|"] + [
        f"| {r['path']} | {r['calls']} | {r['median_ms']} | {r['p10_ms']} | {r['p90_ms']} | {r['added_median_ms']} | "
        + (f"{r.get('outside_ms', 'n/a')} | {r.get('added_outside_ms', 'n/a')} | " if clocked else "")
        + f"{r['same_tokens']} |" for r in rows]


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    lines = [f"One local engine ({meta['model']}, CPU float32) behind both paths; a chat call of "
             f"{meta['max_tokens']} greedy new tokens. added: the median of each call's difference from the Python "
             "call on token ids next to it; outside the engine: the median of each call's time less the engine's own "
             "(submitted to finished), and that median less the token-ids call's.", "", *latency_table(rows)]
    st = next((r for r in rows if r["measure"] == "streaming"), None)
    if st:
        lines += ["", f"Streaming: a chat call of {st['max_tokens']} greedy tokens with the `openai` package, whole and "
                  f"with `stream: true`, {st['calls']} of each, interleaved (medians).", "",
                  "| whole call ms | streamed: first text ms | streamed: end ms | text chunks | same text |",
                  "|---|---|---|---|---|",
                  f"| {st['whole_median_ms']} | {st['first_text_median_ms']} | {st['stream_end_median_ms']} | "
                  f"{st['text_chunks']} | {st['same_text']} |"]
    s = next((r for r in rows if r["measure"] == "sessions"), None)
    if s:
        lines += ["", f"{s['rounds']} rounds of {s['sessions']:,} sessions (one call each, {s['threads']} client "
                  "threads), each round held at once, then released. RSS: before, then per round with its sessions held and "
                  "after their release; growth: the most a later round held over what the second round held; band: "
                  "the spread of what the rounds of the second half held (flat once the allocator settled). Python "
                  "heap: what a held session keeps (tracemalloc, first round).", "",
                  "| sessions held at once | calls/s | RSS MiB | RSS growth after round 2, MiB | held RSS band, second "
                  "half, MiB | Python heap KiB per session | released |",
                  "|---|---|---|---|---|---|---|",
                  f"| {s['held']:,} | {s['calls_per_s']} | {' / '.join(map(str, s['rss_mib']))} | "
                  f"{s.get('rss_growth_after_round_2_mib', '')} | {s.get('rss_held_band_mib', '')} | "
                  f"{s['python_kib_per_session']} | {s['released']:,} |"]
    h = next((r for r in rows if r["measure"] == "history"), None)
    if h:
        lines += ["", "A chat history growing by a turn a call (about 250 tokens a turn), rendered whole each call: "
                  f"the call's prompt in ms (median of {h['sessions']} sessions) as the endpoint renders it, keeping "
                  "the ids of text it rendered before, and through the tokenizer's apply_chat_template; same ids: "
                  f"{h['same_ids']}.", "", "| turns | tokens | endpoint ms | apply_chat_template ms |",
                  "|---|---|---|---|"] + [f"| {r['turns']} | {r['tokens']:,} | {r['ms']} | {r['whole_ms']} |"
                                          for r in h["rows"]]
    return lines


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
