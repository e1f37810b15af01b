"""WO, the OpenAI endpoint's benchmark (benchmarks/harness/openai_bench.py), on the tests' word model: every path
gives the Python client's tokens, a streamed answer comes token by token and adds up to the whole one, and the
sessions part holds and then releases every session it made."""
from __future__ import annotations

from benchmarks.harness.openai_bench import TOKEN, markdown, measure_latency, measure_sessions, measure_streaming
from rollout_service.openai import serve_openai

pytest_plugins = ["openai_setup"]


def test_the_benchmark_times_every_path_on_the_same_tokens_and_releases_its_sessions(client):
    server = serve_openai(client, port=0, block=False, token=TOKEN)
    try:
        rows = measure_latency(client, server, calls=3, max_tokens=3)
        streaming = measure_streaming(server, calls=2, max_tokens=6)
        sessions = measure_sessions(server, sessions=12, threads=4, max_tokens=2, rounds=3)
    finally:
        server.stop()
    assert [r["path"] for r in rows] == ["python client, token ids", "python client, messages", "HTTP, httpx",
                                         "HTTP, openai package"]
    for r in rows:
        assert r["calls"] == 3 and r["same_tokens"] is True and r["p10_ms"] <= r["median_ms"] <= r["p90_ms"], r
        # each call's engine time was read (the endpoint's through its client), and is part of its wall time
        assert 0 < r["outside_ms"] < r["median_ms"], r
    assert rows[0]["added_median_ms"] == 0 and rows[0]["added_outside_ms"] == 0
    assert server.app.state.runtime.svc.client is client  # the clock's wrapper taken off again
    assert sessions["held"] == 12 and sessions["released"] == 36 and sessions["tokens"] == 72, sessions
    assert len(sessions["rss_mib"]) == 7 and sessions["python_kib_per_session"] > 0, sessions
    assert isinstance(sessions["rss_growth_after_round_2_mib"], float) and sessions["rss_held_band_mib"] >= 0
    assert len(server.app.state.sessions) == 0
    assert streaming["same_text"] is True and streaming["text_chunks"] == 6, streaming
    assert streaming["first_text_median_ms"] <= streaming["stream_end_median_ms"], streaming
    text = "\n".join(markdown({"model": "word", "max_tokens": 3}, rows + [streaming, sessions]))
    assert "| HTTP, openai package | 3 |" in text and "| 12 | " in text and "| 6 | True |" in text


def test_a_path_whose_engine_time_is_not_known_here_is_compared_without_it():
    """interleaved(): the times outside the engine are compared for the paths whose every call's engine time is
    known (Serve's replicas hold clients of their own), and the table says n/a for the others."""
    from benchmarks.harness.openai_bench import interleaved, latency_table

    last = []
    paths = {name: (lambda name=name: last.append(name) or [1, 2]) for name in ("ids", "endpoint", "replicas")}
    rows = interleaved(paths, calls=4, engine_ms=lambda: None if last[-1] == "replicas" else 0.0)
    by = {r["path"]: r for r in rows}
    assert "outside_ms" in by["ids"] and "outside_ms" in by["endpoint"] and "outside_ms" not in by["replicas"]
    assert by["ids"]["added_outside_ms"] == 0 and all(r["same_tokens"] for r in rows)
    table = latency_table(rows)
    assert "outside the engine" in table[0] and table[-1].count("n/a") == 2 and "n/a" not in table[-2]


def test_a_growing_history_renders_the_templates_ids(smollm2):
    """The history part on the embedded model's tokenizer (its template's special tokens are where the endpoint
    cuts a prompt it rendered before): the same ids as apply_chat_template at every length timed."""
    from benchmarks.harness.openai_bench import measure_history
    from rollout_service.openai.templates import ChatRenderer

    tok = smollm2[1]
    h = measure_history(ChatRenderer(tok, len(tok), {tok.eos_token_id}), turns=(3, 7), sessions=2)
    assert h["same_ids"] is True and [r["turns"] for r in h["rows"]] == [3, 7], h
    assert h["rows"][0]["tokens"] < h["rows"][1]["tokens"] and all(r["ms"] > 0 for r in h["rows"]), h
    assert "| 7 | " in "\n".join(markdown({"model": "m", "max_tokens": 3}, [h]))
