"""`kdtree serve --tp 2` (two CPU ranks over gloo): the same text as one process, requests arriving together run
concurrently through the ranks' continuous batch with each one's text that of one process, a stop string ends the
request on both ranks (the next request still runs), and a SIGTERM to the whole process group (a service manager, Ctrl-C)
shuts down gracefully with exit 0 and no rank left behind."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
from server_proc import Server

from kdtree_engine import LLM, SamplingParams

PROMPT = "def quicksort(items):"
PROMPTS = ["def quicksort(items):", "class Stack:", "import os\n", "def main():"]


def test_tp2_server_text_stop_strings_and_group_sigterm() -> None:
    one = LLM(device="cpu", threads=1, progress=False)
    want = one.generate(PROMPT, SamplingParams(max_tokens=16))[0].text
    wants = [one.generate(p, SamplingParams(max_tokens=8 + 2 * i))[0].text for i, p in enumerate(PROMPTS)]
    s = Server("--tp", "2", "--device", "cpu", "--threads", "1", "--served-model-name", "tiny")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=120, max_retries=0)
        got = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
        assert got.choices[0].text == want
        with ThreadPoolExecutor(len(PROMPTS)) as pool:   # together: the batch's steps on both ranks
            texts = list(pool.map(lambda i: c.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=8 + 2 * i,
                                                                 temperature=0).choices[0].text, range(len(PROMPTS))))
        assert texts == wants
        assert "continuous batching" in s.output(), s.output()[-2000:]
        cut = want[: max(1, len(want) // 2)][-3:]   # a stop string inside the text: the request ends there
        stopped = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[cut])
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == want[: want.index(cut)]
        again = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
        assert again.choices[0].text == want   # the ranks left the stopped request after the same round
        assert s.terminate(timeout=60, group=True) == 0, s.output()[-2000:]
        deadline = time.monotonic() + 30
        while s.group_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not s.group_alive(), "a rank outlived the server"
    finally:
        s.kill()
