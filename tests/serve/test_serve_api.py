"""The real ``kdtree serve`` (the embedded demo) through the ``openai`` client: text against the Python API,
streaming against whole responses, stop strings, usage, bad input, disconnects, metrics."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_proc import Server

from kdtree_engine import LLM, SamplingParams

TIMEOUT_S = 60
PROMPT = "def quicksort(items):"
N_TOKENS = 24


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.kill()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def llm():
    return LLM(threads=1, progress=False)   # the independent path: the Python API in this process


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate(PROMPT, SamplingParams(max_tokens=N_TOKENS))[0]


def complete_stream(client, **kw):
    chunks = list(client.completions.create(model="demo", stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, finish, chunks


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["demo"]


def test_completion_equals_the_python_api_streamed_or_not(client, llm, reference):
    whole = client.completions.create(model="demo", prompt=PROMPT, max_tokens=N_TOKENS, temperature=0)
    assert whole.choices[0].text == reference.text
    assert whole.choices[0].finish_reason == reference.finish_reason
    assert whole.usage.prompt_tokens == len(llm.encode(PROMPT))
    assert whole.usage.completion_tokens == len(reference.token_ids)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    text, finish, chunks = complete_stream(client, prompt=PROMPT, max_tokens=N_TOKENS, temperature=0)
    assert text == reference.text
    assert finish == [reference.finish_reason]
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1   # streamed in pieces


def test_token_id_prompt_and_include_usage(client, llm, reference):
    ids = llm.encode(PROMPT)
    text, _, chunks = complete_stream(client, prompt=ids, max_tokens=N_TOKENS, temperature=0,
                                      stream_options={"include_usage": True})
    assert text == reference.text
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids),
                                                                                    len(reference.token_ids))
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_cuts_exactly_and_counts_the_tokens_up_to_it(client, llm, reference):
    ids, text = reference.token_ids, reference.text
    # a stop string that spans a token boundary, from the middle of the greedy text
    pieces = [llm.decode(ids[:k]) for k in range(len(ids) + 1)]
    k = len(ids) // 2
    start = len(pieces[k]) - 2
    stop = text[start:len(pieces[k]) + 3]
    assert len(stop) == 5 and llm.decode(ids[k - 1:k + 1]) not in ("", stop)
    first = text.index(stop)
    needed = next(n for n in range(len(ids) + 1) if stop in pieces[n])   # tokens until the stop completes
    for stream in (False, True):
        if stream:
            got, finish, _ = complete_stream(client, prompt=PROMPT, max_tokens=N_TOKENS, temperature=0, stop=[stop])
            usage = None
        else:
            r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=N_TOKENS, temperature=0,
                                          stop=stop)
            got, finish, usage = r.choices[0].text, [r.choices[0].finish_reason], r.usage
        assert got == text[:first]
        assert finish == ["stop"]
        if usage is not None:
            assert usage.completion_tokens == needed


MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": [{"type": "text", "text": "A quicksort, "}, {"type": "text", "text": "please."}]}]


def test_chat_equals_the_python_api_streamed_or_not(client, llm):
    flat = [MESSAGES[0], {"role": "user", "content": "A quicksort, please."}]
    ids = llm.tokenizer.encode(llm.tokenizer.render_chat(flat, add_generation_prompt=True), special=True)
    ref = llm.generate(ids, SamplingParams(max_tokens=N_TOKENS))[0]
    whole = client.chat.completions.create(model="demo", messages=MESSAGES, max_completion_tokens=N_TOKENS,
                                           temperature=0)
    msg = whole.choices[0].message
    assert (msg.role, msg.content, whole.choices[0].finish_reason) == ("assistant", ref.text, ref.finish_reason)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    chunks = list(client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=N_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [ref.finish_reason]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), len(ref.token_ids))


def test_sampled_request_is_reproducible_with_a_seed(client):
    kw = dict(model="demo", prompt=PROMPT, max_tokens=12, temperature=0.8, top_p=0.9, seed=7,
              extra_body={"top_k": 50})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 12


BIG = 10 * 2**20


def post(server, path, content, headers=None):
    return httpx.post(server.url + path, content=content, timeout=TIMEOUT_S,
                      headers={"content-type": "application/json", **(headers or {})})


def body(**fields):
    return json.dumps({"model": "demo", "prompt": PROMPT, **fields})


BAD = [  # (body, status, the field the message names)
    ("{not json", 400, None),
    ("[1, 2]", 400, None),
    (body(max_tokens="12"), 400, "max_tokens"),
    (body(temperature="hot"), 400, "temperature"),
    (body(prompt=5), 400, "prompt"),
    (body(max_tokens=-1), 400, "max_tokens"),
    (body(max_tokens=0), 400, "max_tokens"),
    (body(max_tokens=10**12), 400, "max_tokens"),
    (body(max_tokens=4090), 400, "max_tokens"),
    (body(prompt="x " * 5000), 400, "prompt"),
    (body(prompt=[10**9]), 400, "prompt"),
    (body(temperature=-0.5), 400, "temperature"),
    (body(top_p=0), 400, "top_p"),
    (body(top_p=1.5), 400, "top_p"),
    (body(n=2), 400, "n"),
    (body(logprobs=1), 400, "logprobs"),
    (body(frobnicate=True), 400, "frobnicate"),
    (body(stream_options={"include_usage": True, "extra": 1}), 400, "stream_options.extra"),
    (body(stop=[1, 2]), 400, "stop"),
    (json.dumps({"prompt": PROMPT}), 400, "model"),
    (body(model="gpt-4"), 404, "model"),
]


@pytest.mark.parametrize("raw,status,param", BAD, ids=[f"{i}-{s}-{p}" for i, (_, s, p) in enumerate(BAD)])
def test_bad_completion_input(server, raw, status, param):
    r = post(server, "/v1/completions", raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    if param is not None:
        assert param.split(".")[0] in err["message"]
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200


CHAT_BAD = [
    (json.dumps({"model": "demo", "messages": []}), 400, "messages"),
    (json.dumps({"model": "demo", "messages": [{"role": "wizard", "content": "hi"}]}), 400, "messages[0].role"),
    (json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}), 400,
     "logprobs"),
    (json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "n": 3}), 400, "n"),
    (json.dumps({"model": "demo", "messages": [{"role": "tool", "content": "hi"}]}), 400, "messages"),
    (json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                 "max_completion_tokens": 9}), 400, "max_completion_tokens"),
    (json.dumps({"model": "demo", "messages": [{"role": "user", "content": 7}]}), 400, "messages[0].content"),
]


@pytest.mark.parametrize("raw,status,param", CHAT_BAD, ids=[p for _, _, p in CHAT_BAD])
def test_bad_chat_input(server, raw, status, param):
    r = post(server, "/v1/chat/completions", raw)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200


def test_a_10_mb_body_is_413(server):
    r = post(server, "/v1/completions", b'{"model": "demo", "prompt": "' + b"x" * BIG + b'"}')
    assert r.status_code == 413 and "body" in r.json()["error"]["message"]

    def chunks():   # no Content-Length: the cap applies while the body streams in
        yield b'{"model": "demo", "prompt": "'
        for _ in range(10):
            yield b"x" * 2**20
        yield b'"}'
    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=TIMEOUT_S)
    assert r.status_code == 413
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200


def metric_values(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT_S).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def delta(before, after, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_a_client_gone_mid_stream_frees_the_worker(server, client):
    before = metric_values(server)
    stream = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    t0 = time.monotonic()
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    assert time.monotonic() - t0 < 30   # 4000 tokens would take minutes on this CPU
    after = metric_values(server)
    assert delta(before, after, "kdtree:request_success_total", finished_reason="abort") == 1
    assert delta(before, after, "kdtree:request_success_total", finished_reason="length") == 1


def test_metrics_count_the_requests_sent(server, client):
    before = metric_values(server)
    a = client.completions.create(model="demo", prompt=PROMPT, max_tokens=5, temperature=0)
    text, _, _ = complete_stream(client, prompt=PROMPT, max_tokens=7, temperature=0)
    b = client.completions.create(model="demo", prompt=PROMPT, max_tokens=N_TOKENS, temperature=0,
                                  stop=a.choices[0].text[-3:])   # past the first token: a round runs
    assert post(server, "/v1/completions", body(n=2)).status_code == 400
    assert post(server, "/v1/completions", body(model="nope")).status_code == 404
    after = metric_values(server)
    n_prompt = a.usage.prompt_tokens
    assert delta(before, after, "kdtree:request_success_total", finished_reason="length") == 2
    assert delta(before, after, "kdtree:request_success_total", finished_reason="stop") == 1
    assert delta(before, after, "kdtree:request_rejected_total", status_code="400") == 1
    assert delta(before, after, "kdtree:request_rejected_total", status_code="404") == 1
    assert delta(before, after, "kdtree:prompt_tokens_total") == 3 * n_prompt
    assert delta(before, after, "kdtree:generation_tokens_total") == 5 + 7 + b.usage.completion_tokens
    assert delta(before, after, "kdtree:time_to_first_token_seconds_count") == 3
    assert delta(before, after, "kdtree:e2e_request_latency_seconds_count") == 3
    rounds = delta(before, after, "kdtree:spec_decode_num_rounds_total")
    assert rounds >= 1 and delta(before, after, "kdtree:spec_decode_tokens_per_round_count") == rounds
    drafted = delta(before, after, "kdtree:spec_decode_num_draft_tokens_total")
    accepted = delta(before, after, "kdtree:spec_decode_num_accepted_tokens_total")
    assert 0 < drafted <= 16 * rounds and 0 <= accepted <= drafted   # at most the demo budget (16) a round
    per_pos = sum(v for (name, _), v in after.items() if name == "kdtree:spec_decode_num_accepted_tokens_per_pos_total") \
        - sum(v for (name, _), v in before.items()
              if name == "kdtree:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == accepted
    # requests share each batched forward: no request has a verify time of its own (docs/serve.md)
    assert delta(before, after, "kdtree:spec_decode_verify_time_per_round_seconds_count") == 0
    assert after[("kdtree:num_requests_waiting", ())] == 0 and after[("kdtree:num_requests_running", ())] == 0
