"""`kdtree serve` with continuous batching (the default at tp 1): concurrent streamed requests each give their solo
text (the Python API's ``LLM.generate``, one request alone, is the oracle), a client gone mid-stream frees its
request and its cache, the queue bound counts the requests the batch has no cache for yet, and ``--no-batching``
runs one at a time."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_proc import Server

from kdtree_engine import LLM, SamplingParams

TIMEOUT_S = 120
PROMPTS = ["def quicksort(items):", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(path):",
           "def fibonacci(n):", "for i in range(10):", "def read_json(path):", "class Node:",
           "def binary_search(items, target):"]
LONG = {"prompt": "def f(x):", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm():
    return LLM(threads=1, progress=False)   # the oracle: each request alone, in this process


@pytest.fixture(scope="module")
def server():
    s = Server("--max-batch-tokens", "256")
    yield s
    s.kill()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT_S).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def gauges(server) -> dict[str, float]:
    return {k: v for k, v in metrics(server).items()
            if k in ("kdtree:num_requests_running", "kdtree:num_requests_waiting", "kdtree:kv_cache_usage_perc")}


def wait_for(server, want: dict[str, float], timeout: float = 30) -> dict[str, float]:
    """The gauges once they read ``want`` (they follow the worker's next step), or what they read at the timeout."""
    deadline = time.monotonic() + timeout
    while (got := gauges(server)) and any(got[k] != v for k, v in want.items()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def stream_text(c: openai.OpenAI, **kw) -> tuple[str, list[str]]:
    chunks = list(c.completions.create(model="demo", stream=True, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    return text, [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]


def make_requests(llm, seed: int) -> list[tuple[dict, str, str]]:
    """(request, expected text, expected finish reason) for each prompt: greedy or sampled with a seed, different
    lengths, half of them with a stop string taken from the middle of their solo text."""
    rng = random.Random(seed)
    out = []
    for i, prompt in enumerate(PROMPTS):
        sampled = i % 3 == 2
        kw = dict(prompt=prompt, max_tokens=rng.randint(8, 40), temperature=0.8 if sampled else 0.0,
                  seed=rng.randrange(1 << 30) if sampled else None, extra_body={"ignore_eos": True})
        solo = llm.generate(prompt, SamplingParams(max_tokens=kw["max_tokens"], temperature=kw["temperature"],
                                                   seed=kw["seed"], ignore_eos=True))[0]
        text, finish = solo.text, solo.finish_reason
        if i % 2 == 1 and len(text) > 8:
            at = rng.randrange(2, len(text) - 3)
            kw["stop"] = [text[at:at + 3]]
            text, finish = text[:text.index(kw["stop"][0])], "stop"
        out.append(({k: v for k, v in kw.items() if v is not None}, text, finish))
    return out


def test_concurrent_streams_equal_their_solo_runs_and_a_client_gone_frees_its_request(server, llm):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    requests = make_requests(llm, seed)
    with client(server) as c, httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
        # a long request streams the whole time: the others can only finish beside it, in the same batch
        with http.stream("POST", "/v1/completions", json={"model": "demo", "stream": True, **LONG}) as long:
            lines = long.iter_lines()   # kept: a dropped iterator closes the connection
            next(lines)
            with ThreadPoolExecutor(len(requests)) as pool:
                got = list(pool.map(lambda r: stream_text(c, **r[0]), requests))
            for (kw, text, finish), (got_text, got_finish) in zip(requests, got):
                assert got_text == text, kw
                assert got_finish == [finish], kw
            during = gauges(server)
            assert during["kdtree:num_requests_running"] == 1 and during["kdtree:kv_cache_usage_perc"] > 0
        # the long request's client is gone: its request ends at the next step and gives its cache back
        after = wait_for(server, {"kdtree:num_requests_running": 0, "kdtree:kv_cache_usage_perc": 0})
        assert after == {"kdtree:num_requests_running": 0, "kdtree:num_requests_waiting": 0,
                         "kdtree:kv_cache_usage_perc": 0}
        r = c.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4


def test_the_queue_bound_counts_requests_without_cache(llm):
    """A pool of one long request and a block: a second request waits in the batch for cache (it counts against
    --max-queue 1), a third is refused with 503; the waiting one runs once the first is gone. Then SIGTERM during a
    batched request."""
    s = Server("--cache-tokens", "4096", "--max-queue", "1", "--shutdown-timeout", "2")
    try:
        with httpx.Client(base_url=s.url, timeout=TIMEOUT_S) as http:
            body = {"model": "demo", "stream": True, **LONG}
            with http.stream("POST", "/v1/completions", json=body) as first:
                lines = first.iter_lines()
                next(lines)
                with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 100}) as second:
                    assert second.status_code == 200
                    got = wait_for(s, {"kdtree:num_requests_waiting": 1})
                    assert (got["kdtree:num_requests_waiting"], got["kdtree:num_requests_running"]) == (1, 1)
                    r = http.post("/v1/completions", json={**body, "stream": False})
                    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
                    first.close()
                    text = "".join(second.iter_lines())
                    assert '"finish_reason":"length"' in text.replace(" ", "") and "[DONE]" in text
            assert wait_for(s, {"kdtree:num_requests_running": 0})["kdtree:num_requests_running"] == 0
            # SIGTERM while the batch runs a long request: --shutdown-timeout 2 cancels it, the server exits 0
            with http.stream("POST", "/v1/completions", json=body) as running:
                lines = running.iter_lines()
                next(lines)
                assert s.terminate(timeout=60) == 0, s.output()[-2000:]
    finally:
        s.kill()


def test_no_batching_runs_one_at_a_time_with_the_same_text(llm):
    want = llm.generate(PROMPTS[1], SamplingParams(max_tokens=12))[0].text
    s = Server("--no-batching")
    try:
        assert "one at a time (--no-batching)" in s.output()
        with client(s) as c:
            with ThreadPoolExecutor(2) as pool:
                got = list(pool.map(lambda _: stream_text(c, prompt=PROMPTS[1], max_tokens=12, temperature=0),
                                    range(2)))
        assert got == [(want, ["length"])] * 2
        # a request alone has its own verify time (not so in the batch)
        assert metrics(s)["kdtree:spec_decode_verify_time_per_round_seconds_count"] == 2
    finally:
        s.kill()
