"""Load test of ``kdtree serve`` on the embedded demo: many concurrent clients, streaming and not, some leaving
mid-stream; then the same requests one at a time through the server and through the Python API (the server's
overhead).

Phases: start the real server (a subprocess, 127.0.0.1, a free port) and warm it up; ``--requests`` requests from
``--concurrency`` clients (a mix: ``--stream-fraction`` streamed, ``--disconnect-fraction`` of those closed after
their first chunks), run concurrently by the server's continuous batch (``--no-batching``: one at a time);
check that every request completed or got a clean error and nothing hung, and the server's memory (RSS) before
and after; ``--sequential`` of the completed requests again, one at a time, through the server;
SIGTERM (exit status recorded); the same sequential requests through ``LLM.generate`` in this process.

Times: time to first token (TTFT) from sending the request to the first text chunk (under load it includes the
wait in the queue); inter-token latency (ITL) per request = (last chunk - first chunk) / (completion tokens - 1).
Writes bench/results/serve-load-cpu.{json,md} (or ``--out``/``--stem``) with the run's metadata.

    python bench/serve_load.py                      # 200 requests, 16 clients, 32 tokens each
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import md_table, write_results  # noqa: E402
from kdtree_engine import LLM, SamplingParams  # noqa: E402

PROMPTS = ["def quicksort(items):", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(path):",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"", "for i in range(10):",
           "def read_json(path):", "class Node:", "def binary_search(items, target):"]
LISTEN = re.compile(r"serving '.*' on http://127\.0\.0\.1:(\d+)")
REQUEST_TIMEOUT_S = 600


@dataclass
class Spec:
    prompt: str
    max_tokens: int
    stream: bool
    disconnect_after: int | None   # chunks read before closing (streamed only)


@dataclass
class Outcome:
    kind: str                      # "ok" | "disconnected" | "http_<status>" | "error" | "timeout"
    ttft_s: float | None = None
    itl_s: float | None = None
    latency_s: float | None = None
    completion_tokens: int | None = None
    text: str | None = None


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def summary(xs: list[float]) -> dict[str, float | None]:
    return {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99),
            "mean": statistics.fmean(xs) if xs else None}


async def one(http: httpx.AsyncClient, spec: Spec) -> Outcome:
    body = {"model": "demo", "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0,
            "stream": spec.stream, "ignore_eos": True}
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    try:
        if not spec.stream:
            r = await http.post("/v1/completions", json=body)
            if r.status_code != 200:
                return Outcome(f"http_{r.status_code}")
            j = r.json()
            return Outcome("ok", latency_s=time.perf_counter() - t0, text=j["choices"][0]["text"],
                           completion_tokens=j["usage"]["completion_tokens"])
        first = last = None
        chunks, text, tokens = 0, [], None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Outcome(f"http_{r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    tokens = obj["usage"]["completion_tokens"]
                for c in obj.get("choices", ()):
                    if c["text"]:
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        text.append(c["text"])
                        chunks += 1
                if spec.disconnect_after is not None and chunks >= spec.disconnect_after:
                    return Outcome("disconnected", ttft_s=first - t0 if first else None)
        itl = (last - first) / (tokens - 1) if tokens and tokens > 1 and first is not None else None
        return Outcome("ok", ttft_s=first - t0 if first else None, itl_s=itl, latency_s=time.perf_counter() - t0,
                       completion_tokens=tokens, text="".join(text))
    except httpx.TimeoutException:
        return Outcome("timeout")
    except httpx.HTTPError as e:
        return Outcome(f"error:{type(e).__name__}")


async def run_clients(url: str, specs: list[Spec], concurrency: int) -> list[Outcome]:
    out: list[Outcome | None] = [None] * len(specs)
    todo = iter(range(len(specs)))
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
        async def client() -> None:
            for i in todo:
                out[i] = await one(http, specs[i])
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return [o for o in out if o is not None]


def start_server(max_queue: int, *flags: str) -> tuple[subprocess.Popen, str, Path]:
    log = Path(tempfile.mkstemp(prefix="kdtree-serve-load-", suffix=".log")[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "kdtree_engine", "serve", "--port", "0", "--max-queue",
                             str(max_queue), *flags], cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        m = LISTEN.search(log.read_text())
        if m:
            url = f"http://127.0.0.1:{m[1]}"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return proc, url, log
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the server did not start")


def make_specs(n: int, max_tokens: int, stream_fraction: float, disconnect_fraction: float,
               rng: random.Random) -> list[Spec]:
    specs = []
    for _ in range(n):
        stream = rng.random() < stream_fraction
        leave = stream and rng.random() < disconnect_fraction / max(stream_fraction, 1e-9)
        specs.append(Spec(rng.choice(PROMPTS), max_tokens, stream, rng.randint(1, 3) if leave else None))
    return specs


def python_api(specs: list[Spec]) -> list[Outcome]:
    """The same requests through ``LLM.generate`` in this process, one at a time (the server's settings: the
    demo with its drafter, one torch thread as ``kdtree serve`` picks for it)."""
    llm = LLM(threads=1, progress=False)
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))   # warm-up, as the server's
    outs = []
    for s in specs:
        stamps: list[float] = []
        t0 = time.perf_counter()
        res = llm.generate(s.prompt, SamplingParams(max_tokens=s.max_tokens, ignore_eos=True),
                           on_tokens=lambda toks: stamps.append(time.perf_counter()))[0]
        n = len(res.token_ids)
        itl = (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else None
        outs.append(Outcome("ok", ttft_s=stamps[0] - t0, itl_s=itl, latency_s=time.perf_counter() - t0,
                            completion_tokens=n, text=res.text))
    return outs


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--stream-fraction", type=float, default=0.6)
    ap.add_argument("--disconnect-fraction", type=float, default=0.1, help="of all requests")
    ap.add_argument("--sequential", type=int, default=24, help="requests repeated one at a time (overhead)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-batching", action="store_true", help="the server runs one request at a time")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--stem", default="serve-load-cpu")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    specs = make_specs(args.requests, args.max_tokens, args.stream_fraction, args.disconnect_fraction, rng)
    settings = {k: getattr(args, k) for k in ("requests", "concurrency", "max_tokens", "stream_fraction",
                                              "disconnect_fraction", "sequential", "seed", "no_batching")}
    settings.update(model="demo (its drafter, DDTree budget 16)", temperature=0, ignore_eos=True,
                    max_queue=args.concurrency * 2)

    load_before = os.getloadavg()   # the host's load: other work on its cores slows every phase
    proc, url, log = start_server(args.concurrency * 2, *(["--no-batching"] if args.no_batching else []))
    try:
        asyncio.run(run_clients(url, make_specs(8, args.max_tokens, 0.5, 0.0, random.Random(1)), 4))  # warm-up
        rss_before = rss_mb(proc.pid)
        t0 = time.perf_counter()
        outs = asyncio.run(asyncio.wait_for(run_clients(url, specs, args.concurrency), REQUEST_TIMEOUT_S * 2))
        load_s = time.perf_counter() - t0
        rss_after = rss_mb(proc.pid)
        healthy = httpx.get(url + "/health", timeout=30).status_code == 200
        mtext = httpx.get(url + "/metrics", timeout=30).text
        done = [s for s, o in zip(specs, outs) if o.kind == "ok"][:args.sequential]
        seq_server = asyncio.run(run_clients(url, [Spec(s.prompt, s.max_tokens, True, None) for s in done], 1))
        proc.send_signal(signal.SIGTERM)
        exit_status = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.unlink(missing_ok=True)
    seq_api = python_api(done)
    load_after = os.getloadavg()

    kinds: dict[str, int] = {}
    for o in outs:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    ok = [o for o in outs if o.kind == "ok"]
    streamed = [o for s, o in zip(specs, outs) if o.kind == "ok" and s.stream]
    same_text = all(a.text == b.text for a, b in zip(seq_server, seq_api))
    payload = {
        "settings": settings,
        "outcomes": kinds,
        "all_accounted": len(outs) == len(specs) and set(kinds) <= {"ok", "disconnected"},
        "hung": kinds.get("timeout", 0),
        "load_wall_s": load_s,
        "host_load_average_1_5_15": {"before": load_before, "after": load_after},
        "host_cpus": os.cpu_count(),
        "completed_tokens_per_s": sum(o.completion_tokens or 0 for o in ok) / load_s,
        "healthy_after": healthy,
        "sigterm_exit_status": exit_status,
        "server_rss_mb": {"after_warmup": rss_before, "after_load": rss_after, "growth": rss_after - rss_before},
        "server_metrics": {
            "request_success_total": metric(mtext, "kdtree:request_success_total"),
            "abort": sum(float(line.rsplit(" ", 1)[1]) for line in mtext.splitlines()
                         if line.startswith("kdtree:request_success_total") and 'finished_reason="abort"' in line),
            "generation_tokens_total": metric(mtext, "kdtree:generation_tokens_total"),
            "ttft_mean_s": metric(mtext, "kdtree:time_to_first_token_seconds_sum")
            / max(metric(mtext, "kdtree:time_to_first_token_seconds_count"), 1),
            "itl_mean_s": metric(mtext, "kdtree:inter_token_latency_seconds_sum")
            / max(metric(mtext, "kdtree:inter_token_latency_seconds_count"), 1),
        },
        "under_load": {"ttft_s": summary([o.ttft_s for o in streamed if o.ttft_s is not None]),
                       "itl_s": summary([o.itl_s for o in streamed if o.itl_s is not None]),
                       "latency_s": summary([o.latency_s for o in ok if o.latency_s is not None])},
        "sequential_server": {"ttft_s": summary([o.ttft_s for o in seq_server if o.ttft_s is not None]),
                              "itl_s": summary([o.itl_s for o in seq_server if o.itl_s is not None])},
        "sequential_python_api": {"ttft_s": summary([o.ttft_s for o in seq_api if o.ttft_s is not None]),
                                  "itl_s": summary([o.itl_s for o in seq_api if o.itl_s is not None])},
        "sequential_same_text": same_text,
        "requests": [{**asdict(s), **{k: v for k, v in asdict(o).items() if k != "text"}}
                     for s, o in zip(specs, outs)],
    }

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}"

    rows = [[name, d["ttft_s"]["n"], ms(d["ttft_s"]["p50"]), ms(d["ttft_s"]["p99"]), ms(d["itl_s"]["p50"]),
             ms(d["itl_s"]["p99"])]
            for name, d in (("server, under load (streamed)", payload["under_load"]),
                            ("server, one at a time", payload["sequential_server"]),
                            ("Python API, one at a time", payload["sequential_python_api"]))]
    md = ["# kdtree serve under load (CPU, the demo)", "",
          f"Settings: {json.dumps(settings)}", "",
          f"Outcomes: {kinds} of {len(specs)} requests; all completed or left by their client as planned: "
          f"{payload['all_accounted']}; hung: {payload['hung']}; /health after: {healthy}; SIGTERM exit status: "
          f"{exit_status}.", "",
          f"Server RSS: {rss_before:.1f} MB after warm-up, {rss_after:.1f} MB after the load "
          f"({rss_after - rss_before:+.1f} MB). Load phase: {load_s:.1f} s, "
          f"{payload['completed_tokens_per_s']:.1f} completed tokens/s. Host: {os.cpu_count()} CPUs, load average "
          f"(1/5/15 min) {load_before[0]:.1f}/{load_before[1]:.1f}/{load_before[2]:.1f} before, "
          f"{load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f} after (other work on the host slows "
          "every phase; the server and the client share its cores).", "",
          "TTFT from sending the request to the first text chunk (under load it includes the wait in the queue; "
          + ("one request runs at a time" if args.no_batching else "requests run concurrently in the continuous "
             "batch") + "); ITL per request = (last chunk - first chunk) / (tokens - 1), in ms:", ""]
    md += md_table(["path", "requests", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"], rows)
    md += ["", f"Sequential texts equal between server and Python API: {same_text}."]
    write_results(args.out, args.stem, payload, md, device="cpu")
    print("\n".join(md))
    return payload


if __name__ == "__main__":
    main()
