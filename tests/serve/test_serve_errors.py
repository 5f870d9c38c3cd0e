"""Unexpected failures become logged 500s with an error object, and the server keeps serving (in process, over a
stand-in model whose calls fail on purpose, run one at a time or in a stand-in batch)."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from kdtree_engine.serve.app import ServeSettings, build_app
from kdtree_engine.speculative.decode import GenerationResult


class FailingModel:
    """Tokenizes "fail-encode" with an error, generates with an error for prompts starting with token 13."""

    def __init__(self) -> None:
        self.target = SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=64, vocab_size=100))
        self.tokenizer = SimpleNamespace(has_chat_template=False)

    def encode(self, prompt):
        if prompt == "fail-encode":
            raise KeyError("a tokenizer bug")
        return [int(t) for t in prompt] if isinstance(prompt, list) else [ord(c) % 100 for c in prompt]

    def decode(self, ids):
        return "".join(chr(97 + t % 26) for t in ids)

    def generate(self, ids, params, on_tokens=None, stoppable=False):
        if ids[0] == 13:
            raise RuntimeError("an engine bug")
        toks = [1, 2, 3][:params.max_tokens]
        on_tokens(toks)
        return [GenerationResult(toks, "length", {"spec": "none", "rounds": 0})]


def test_unexpected_errors_are_500_objects_and_the_server_keeps_serving(caplog):
    app = build_app(FailingModel(), ServeSettings(served_model_name="m"))
    with TestClient(app, raise_server_exceptions=False) as http:
        for prompt in ("fail-encode", [13, 5]):
            for stream in (False, True):
                r = http.post("/v1/completions", json={"model": "m", "prompt": prompt, "stream": stream})
                if stream and prompt != "fail-encode":   # the failure comes after the stream began
                    assert r.status_code == 200 and '"type": "server_error"' in r.text and "[DONE]" in r.text
                else:
                    assert r.status_code == 500, r.text
                    err = r.json()["error"]
                    assert err["type"] == "server_error" and err["message"]
                assert http.get("/health").json() == {"status": "ok"}
        r = http.post("/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "bcd"
        metrics = http.get("/metrics").text
    assert 'kdtree:request_success_total{finished_reason="error",model_name="m"} 2.0' in metrics
    assert 'kdtree:request_rejected_total{model_name="m",status_code="500"} 3.0' in metrics
    assert "a tokenizer bug" in caplog.text and "an engine bug" in caplog.text   # logged with the traceback


class FakeSequence:
    def __init__(self, ids: list[int], max_tokens: int, on_tokens) -> None:
        self.ids, self.max_tokens, self.on_tokens = ids, max_tokens, on_tokens
        self.done, self.rounds, self.result, self.cancelled = False, None, None, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeBatch:
    """A stand-in continuous batch: every request ends at the step after it joined, with tokens [1, 2, 3]; a step
    with a request whose prompt starts with 13 raises; a prompt starting with 14 is refused at submit."""

    def __init__(self) -> None:
        self.waiting: list[FakeSequence] = []
        self.pool = SimpleNamespace(free_blocks=4, num_blocks=4)

    @property
    def idle(self) -> bool:
        return not self.waiting

    def submit(self, ids, params, on_tokens) -> FakeSequence:
        if ids[0] == 14:
            raise ValueError("a refused prompt")
        seq = FakeSequence(ids, params.max_tokens, on_tokens)
        self.waiting.append(seq)
        return seq

    def step(self) -> list[FakeSequence]:
        if any(s.ids[0] == 13 for s in self.waiting):
            raise RuntimeError("a batch bug")
        ended, self.waiting = self.waiting, []
        for s in ended:
            toks = [1, 2, 3][:s.max_tokens]
            stopped = s.cancelled or s.on_tokens(toks)
            s.done, s.result = True, GenerationResult(toks, "abort" if stopped else "length", {"spec": "none"})
        return ended


    def drop_all(self) -> list[FakeSequence]:
        """After a failed step (Scheduler.drop_all): every request ends, its blocks back."""
        ended, self.waiting = self.waiting, []
        for s in ended:
            s.done, s.result = True, GenerationResult([], "abort", {"spec": "none"})
        return ended


class BatchingModel(FailingModel):
    def scheduler(self, token_budget=None):
        return FakeBatch()

    def submit(self, sched, ids, params, on_tokens=None):
        return sched.submit(ids, params, on_tokens)


def test_a_failed_batch_fails_its_requests_and_a_new_batch_serves_on(caplog):
    app = build_app(BatchingModel(), ServeSettings(served_model_name="m", batching=True))
    with TestClient(app, raise_server_exceptions=False) as http:
        for prompt in ([13, 5], [14, 5]):
            r = http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 3})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        r = http.post("/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "bcd"
        metrics = http.get("/metrics").text
    assert 'kdtree:request_success_total{finished_reason="error",model_name="m"} 2.0' in metrics
    assert 'kdtree:num_requests_running{model_name="m"} 0.0' in metrics
    assert "a batch bug" in caplog.text and "a refused prompt" in caplog.text
