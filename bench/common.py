"""Benchmark helpers: rooflines measured in the same run, graph-replay timing with rotating inputs,
JSON + Markdown writers (every record carries kdtree_engine.records.run_metadata: commit, versions, device,
command, UTC time).

Timing (`time_calls`): the calls (one per rotating input set) are captured once into a CUDA graph and
the graph is replayed; per-call time = median replay time / number of calls. Graph replay removes
Python launch gaps, which would otherwise dominate kernels of 10-50 us; rotating input sets whose
total size exceeds L2 keeps repeated calls from reading the weights out of L2. If capture fails the
same loop is timed eagerly with CUDA events (reported as graph=False).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from kdtree_engine.records import command_line, cpu_model, run_metadata, with_metadata  # noqa: F401 (for the scripts)
from kdtree_engine.bench_spec import device_tag
from kdtree_engine.records import package_version


def device_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    return {
        "gpu": p.name, "sm_count": p.multi_processor_count,
        "l2_bytes": getattr(p, "L2_cache_size", None), "mem_bytes": p.total_memory,
        "torch": torch.__version__, "triton": package_version("triton"), "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def gpu_stem(name: str) -> str:
    """Short device tag for result file names: "h200" for an NVIDIA H200, else the name made file-safe."""
    n = name.lower()
    for key in ("h200", "h100", "b200", "a100", "l40s", "l4"):
        if key in n:
            return key
    return "".join(c if c.isalnum() else "-" for c in n).strip("-") or "gpu"


def l2_bytes() -> int:
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 50 * 2**20)


def _events_median(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)  # us
    return statistics.median(times)


def time_calls(calls: Sequence[Callable[[], object]], reps: int = 20, warmup: int = 2,
               use_graph: bool = True) -> dict:
    """Median microseconds per call over `calls` run back to back (see module docstring)."""
    for _ in range(warmup):
        for c in calls:
            c()
    torch.cuda.synchronize()

    def run_all():
        for c in calls:
            c()

    if use_graph:
        try:
            g = capture_graph(run_all)
            t = _events_median(g.replay, reps)
            del g
            return {"us": t / len(calls), "graph": True}
        except Exception as exc:  # noqa: BLE001 - fall back to eager timing, reported
            torch.cuda.synchronize()
            err = f"{type(exc).__name__}: {exc}"[:200]
            t = _events_median(run_all, reps)
            return {"us": t / len(calls), "graph": False, "graph_error": err}
    t = _events_median(run_all, reps)
    return {"us": t / len(calls), "graph": False}


def host_time_us(calls: Sequence[Callable[[], object]], reps: int) -> float:
    """Median microseconds per call by the host clock (the CPU runs of the benches): one untimed pass, then at least
    3 timed passes over ``calls``."""
    for c in calls:
        c()
    times = []
    for _ in range(max(3, reps)):
        t0 = time.perf_counter()
        for c in calls:
            c()
        times.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return statistics.median(times)


def cpu_copy_bandwidth(n: int = 64 * 2**20, reps: int = 5) -> float:
    """Bytes read + written per second of a host memory copy (the fastest of ``reps``)."""
    a = torch.randint(0, 255, (n,), dtype=torch.uint8)
    b = torch.empty_like(a)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        ts.append(time.perf_counter() - t0)
    return 2 * n / min(ts)


def capture_graph(fn: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """fn run once on a side stream (warm-up), then captured into a CUDA graph, replayed once and synchronized."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def union_us(spans: Sequence[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    busy, cur_s, cur_e = 0.0, None, None
    for st, en in sorted(spans):
        if cur_e is None or st > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = st, en
        else:
            cur_e = max(cur_e, en)
    return busy + (cur_e - cur_s if cur_e is not None else 0.0)


def kernel_profile(fn: Callable[[], object], reps: int = 5, top: int = 20) -> dict:
    """Device time of one call of fn (eager launches under torch.profiler, averaged over reps).
    kernels: [{"name", "calls", "us"}] per kernel name; ops: the same per torch op and input shapes (self
    device time: which op launched a copy or an elementwise kernel). Sorted by time, the first `top` (the
    rest summed as one row)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    acc: dict[str, list[float]] = {}
    for e in prof.events():
        dt = getattr(e, "device_type", None)
        if dt is None or "CUDA" not in str(dt):
            continue
        slot = acc.setdefault(e.name, [0, 0.0])
        slot[0] += 1
        slot[1] += e.time_range.end - e.time_range.start
    ops: dict[str, list[float]] = {}
    for k in prof.key_averages(group_by_input_shape=True):
        us = float(getattr(k, "self_device_time_total", getattr(k, "self_cuda_time_total", 0.0)) or 0.0)
        if us > 0:
            ops[f"{k.key} {k.input_shapes}"] = [k.count, us]

    def table(d: dict[str, list[float]]) -> list[dict]:
        rows = sorted(({"name": k, "calls": v[0] / reps, "us": v[1] / reps} for k, v in d.items()),
                      key=lambda r: -r["us"])
        if len(rows) > top:
            rest = rows[top:]
            rows = rows[:top] + [{"name": f"({len(rest)} others)", "calls": sum(r["calls"] for r in rest),
                                  "us": sum(r["us"] for r in rest)}]
        return rows

    return {"kernels": table(acc), "ops": table(ops)}


def kernel_lines(kernels: Sequence[dict]) -> list[str]:
    """A Markdown table of a profile's kernels (kernel_profile / graph_timeline rows: name, calls, us)."""
    return md_table(["kernel", "calls", "us"], [[k["name"][:90], k["calls"], k["us"]] for k in kernels])


def graph_timeline(fn: Callable[[], object], reps: int = 5) -> dict:
    """Where one call of fn goes inside a CUDA graph: fn captured once, its replays under torch.profiler; per kernel
    in launch order its start (from the first kernel's start), duration and the idle gap before it on the device
    (negative: it overlapped the kernel before it), each the median over the replays. span_us: first start to last
    end; busy_us: the union of the kernels' intervals."""
    import statistics

    from torch.profiler import ProfilerActivity, profile

    g = capture_graph(fn)   # its warm-up run compiles and allocates before the capture
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
            torch.cuda.synchronize()
    kern = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if "CUDA" in str(getattr(e, "device_type", "")) and "Memcpy" not in e.name
                   and "Memset" not in e.name), key=lambda k: k[0])
    del g
    if not kern or len(kern) % reps:
        return {"error": f"{len(kern)} kernel events over {reps} replays", "kernels": []}
    n = len(kern) // reps
    runs = [kern[i * n:(i + 1) * n] for i in range(reps)]
    rows, spans, busys = [], [], []
    for run in runs:
        spans.append(max(e for _, e, _ in run) - run[0][0])
        busys.append(union_us([(st, en) for st, en, _ in run]))
    for i in range(n):
        starts = [run[i][0] - run[0][0] for run in runs]
        durs = [run[i][1] - run[i][0] for run in runs]
        gaps = [run[i][0] - max(e for _, e, _ in run[:i]) if i else 0.0 for run in runs]
        rows.append({"name": runs[0][i][2], "start_us": statistics.median(starts), "us": statistics.median(durs),
                     "gap_us": statistics.median(gaps)})
    return {"kernels": rows, "span_us": statistics.median(spans), "busy_us": statistics.median(busys)}


def copy_bandwidth(nbytes: int = 2 * 2**30, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (B/s)."""
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = time_calls([lambda: b.copy_(a)], reps=reps, use_graph=False)["us"]
    del a, b
    return 2 * nbytes / (t * 1e-6)


def bf16_matmul_rate(n: int = 8192, reps: int = 20) -> float:
    """FLOP/s of a large bf16 matmul on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_calls([lambda: a @ b], reps=reps, use_graph=False)["us"]
    return 2 * n**3 / (t * 1e-6)


def write_results(out_dir: str | Path, stem: str, payload: dict, md_lines: list[str], *,
                  command: str | None = None, device: object = None) -> tuple[Path, Path]:
    """<out_dir>/<stem>.json and .md, both with the run's metadata (`run_metadata(command, device)`: the JSON
    under "meta", the Markdown as a line under its title). ``command`` defaults to this process's command line,
    ``device`` to the current CUDA device (the CPU without one)."""
    meta = run_metadata(command, device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jp = out / f"{stem}.json"
    mp = out / f"{stem}.md"
    jp.write_text(json.dumps({"meta": meta, **payload}, indent=1, default=str) + "\n")
    mp.write_text(with_metadata("\n".join(md_lines), meta) + "\n")
    return jp, mp


def results_saver(out_dir: str | Path, stem: str, markdown: Callable[[dict], list[str]], *, command: str,
                  device: object) -> Callable[[dict], tuple[Path, Path]]:
    """A function that (re)writes the record ``stem`` from a report (:func:`write_results`): a bench calls it after
    every measured row, so a run cut by a time limit keeps what it measured."""
    def save(rep: dict) -> tuple[Path, Path]:
        return write_results(out_dir, stem, rep, markdown(rep), command=command, device=device)
    return save


def bench_main(argv: Sequence[str] | None, script: str, out_dir: str | Path, device: str | None,
               stem: Callable[[str], str], markdown: Callable[[dict, str], list[str]],
               run: Callable[[Callable[[str], None], Callable[[dict], object]], dict]) -> dict:
    """The main of a bench whose ``run(log, save)`` saves its report after every row: the device (``device``, else cuda
    when available), the record ``stem(device tag)`` under ``out_dir`` with the command line of ``script``, the
    report written once more at the end."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tag = device_tag(dev)
    save = results_saver(out_dir, stem(tag), lambda rep: markdown(rep, tag),
                         command=command_line(argv, f"python3 {script}"), device=dev)
    rep = run(lambda m: print(m, flush=True), save)
    jp, mp = save(rep)
    print(f"wrote {jp} and {mp}")
    return rep


def md_table(headers: list[str], rows: list[list]) -> list[str]:
    def f(v):
        if v is None:
            return "n/a"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(f(v) for v in r) + " |" for r in rows]
    return lines


class Clock:
    def __init__(self):
        self.t0 = time.time()

    def __call__(self) -> float:
        return time.time() - self.t0


def _rank_entry(rank: int, rdv: object, body: Callable[..., object], args: tuple, device_type: str,
                out: str) -> None:
    from kdtree_engine.parallel.group import join, leave
    dev = torch.device("cpu") if device_type == "cpu" else torch.device(device_type, rank)
    comm = join(rdv, rank, dev)  # type: ignore[arg-type]
    try:
        result = body(comm, dev, *args)
    finally:
        leave()
    if rank == 0:
        torch.save(result, out)


def run_ranks(world: int, body: Callable[..., object], args: tuple, device_type: str,
              timeout_s: float = 600.0) -> object:
    """``world`` processes, one a device (NCCL, rank r on cuda:r; gloo on the CPU), each joining the group and running
    ``body(comm, device, *args)`` (a module-level function: the processes are spawned); rank 0's return."""
    import tempfile

    import torch.multiprocessing as mp

    from kdtree_engine.parallel.group import Rendezvous, free_port
    if device_type == "cuda" and world > torch.cuda.device_count():
        raise SystemExit(f"--ranks {world}: only {torch.cuda.device_count()} GPUs are visible")
    rdv = Rendezvous("127.0.0.1", free_port(), world, timeout_s)
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "rank0.pt")
        mp.start_processes(_rank_entry, args=(rdv, body, args, device_type, out), nprocs=world, join=True,
                           start_method="spawn")
        return torch.load(out, weights_only=False)
