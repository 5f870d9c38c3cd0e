"""The server's edges: --api-key, a full queue, SIGTERM, a port in use, bad flags (one request at a time:
--no-batching; test_serve_batching.py has the batch's queue bound)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_proc import ROOT, Server

TIMEOUT_S = 60
KEY = "sk-test-key"
LONG = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
        "stream": True}


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server():
    # one request at a time: the queue's bound is the requests behind the running one
    s = Server("--api-key", KEY, "--max-queue", "1", "--served-model-name", "tiny", "--shutdown-timeout", "2",
               "--no-batching")
    yield s
    s.kill()


def test_api_key_is_required_on_v1(server):
    for headers in ({}, auth("wrong"), {"Authorization": KEY}):
        r = httpx.get(server.url + "/v1/models", headers=headers, timeout=TIMEOUT_S)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=TIMEOUT_S, max_retries=0)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.completions.create(model="tiny", prompt="def f(x):", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200


def test_a_full_queue_answers_503_with_retry_after(server):
    with httpx.Client(base_url=server.url, headers=auth(), timeout=TIMEOUT_S) as http:
        with http.stream("POST", "/v1/completions", json=LONG) as running:
            lines = running.iter_lines()   # kept: a dropped iterator closes the connection
            next(lines)                    # it runs
            with http.stream("POST", "/v1/completions", json=LONG) as waiting:
                assert waiting.status_code == 200       # queued: its headers are sent, its tokens wait
                r = http.post("/v1/completions", json={**LONG, "stream": False})
                assert r.status_code == 503 and r.headers["retry-after"]
                assert r.json()["error"]["code"] == "queue_full"
        # both closed: the queue empties and the worker is free again, once the server has seen the
        # disconnects (a client honours Retry-After until then)
        deadline = time.monotonic() + 10
        while (r := http.post("/v1/completions", json={**LONG, "max_tokens": 2, "stream": False})).status_code \
                == 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "kdtree_engine", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_port_in_use_and_bad_flags_are_one_line_exit_2(server):
    port = server.url.rsplit(":", 1)[1]
    for args, flag in ((["--port", port], "--port"), (["--max-queue", "0"], "--max-queue"),
                       (["--max-batch-tokens", "0"], "--max-batch-tokens"),
                       (["--no-batching", "--max-batch-tokens", "64"], "--max-batch-tokens")):
        done = run_cli("serve", *args)
        assert done.returncode == 2, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kdtree: error:") and flag in lines[0], done.stderr
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200


def test_sigterm_during_a_request_exits_0(server):
    with httpx.Client(base_url=server.url, headers=auth(), timeout=TIMEOUT_S) as http:
        with http.stream("POST", "/v1/completions", json=LONG) as running:
            lines = running.iter_lines()
            next(lines)
            t0 = time.monotonic()
            assert server.terminate(timeout=60) == 0, server.output()
            assert time.monotonic() - t0 < 30          # --shutdown-timeout 2 cancels the 4000-token request
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=5)
