"""Python API: load a target, a drafter and a tokenizer; generate.

    from kdtree_engine import LLM, SamplingParams
    llm = LLM()                       # the embedded demo, with its drafter and DDTree budget 16 (as the CLI)
    out = llm.generate("def quicksort(items):", SamplingParams(max_tokens=64))[0]
    print("def quicksort(items):" + out.text, out.stats["tokens_per_s"])
    outs = llm.generate_batch(["def f(x):", "class Stack:"], SamplingParams(max_tokens=32))  # concurrently

``out.text`` is the generated text only, without the prompt (the CLI prints the prompt before it).
Errors name the call's arguments (``spec``, ``draft``, ``budget``, ``device``, ...) in the form
``name=value``; the CLI shows them as its flags (``--name value``).
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from pathlib import Path
from typing import ContextManager, Mapping, Sequence

import torch

from .batch.scheduler import DEFAULT_TOKEN_BUDGET, Scheduler
from .batch.sequence import Sequence as BatchSequence
from .config import ModelConfig
from .errors import BadInput, PromptError, RankFailure
from .exit_codes import BAD_INPUT_ERRORS
from .kernels.dispatch import log_choices, prepare_int4
from .kernels.policy import KernelPolicy
from .logs import log_once
from .model.dflash import DFlashDrafter
from .model.prompt_graph import MAX_BUCKET, PromptGraphs
from .model.target import Target, split_groups
from .parallel.batch import RankedScheduler, follow_batch
from .parallel.broadcast import (BatchOpen, Request, recv_message, recv_round_verdict, send_noop, send_request,
                                 send_round_verdict, send_stop)
from .parallel.comm import SINGLE, Communicator
from .parallel.group import DEFAULT_TIMEOUT_S, leave, rank_device
from .parallel.keepalive import KeepAlive, unguarded
from .parallel.launch import collective_error, start_ranks
from .parallel.memory import log_load
from .parallel.shard import check_divisible
from .fp8 import dequantized_stream
from .quant import Fp8Scheme, QuantError, k2_quantization_config, parse_quantization_config
from .sampling import SamplingParams
from .speculative.config import SpecConfig
from .speculative.decode import GenerationResult, OnTokens, check_prompt, generate, resolve_spec
from .tokenizer import TextTokenizer
from .tokenizer import load_tokenizer as load_text_tokenizer
from .warmup import WarmUpReport
from .warmup import warm_up as run_warm_up
from .weights import checkpoint_scheme, iter_checkpoint

log = logging.getLogger("kdtree_engine")

Prompt = str | Sequence[int]   # text, or token ids
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


DEMO = "demo"
DEMO_DIR = Path(__file__).parent / "assets" / "demo"
DEMO_BUDGET = 16  # the demo's best DDTree budget by tokens/s in `kdtree bench spec` (docs/performance_history.md)

# Torch's intra-op threads pay a synchronisation per operator; decoding runs many small operators per token, so
# below about this many parameters per thread the split work does not pay for it (one thread for the demo).
PARAMS_PER_THREAD = 100_000_000


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        log_once("device", f"device: {device} (automatic)")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise BadInput(f"device={device!r} is not a device: use device='cpu' or device='cuda'")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput(f"device={device!r} was asked for but no CUDA device is available (device='cpu' runs on "
                       "the CPU)")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        log_once("dtype", f"dtype: {dtype} (automatic for {device.type})")
    if dtype not in DTYPES:
        raise BadInput(f"dtype={dtype!r} is not one of {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


def available_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS reports one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def resolve_threads(threads: int | str | None, n_params: int, device: torch.device) -> tuple[int, str] | None:
    """Torch's CPU thread count for a model of ``n_params`` parameters: (threads, why), or None to leave torch's.

    ``threads``: an int sets it; ``"auto"`` picks one thread per ``PARAMS_PER_THREAD`` parameters, at least one
    and at most the CPUs available; None leaves torch's setting. On CUDA the host threads only launch kernels,
    so ``"auto"`` leaves torch's setting there.
    """
    if threads is None or (threads == "auto" and device.type != "cpu"):
        return None
    if threads == "auto":
        cpus = available_cpus()
        n = max(1, min(cpus, n_params // PARAMS_PER_THREAD))
        return n, (f"automatic: {n_params / 1e6:.1f}M parameters, one thread per {PARAMS_PER_THREAD // 10**6}M, "
                   f"{cpus} CPUs available; threads=N sets it")
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise BadInput(f"threads={threads!r} must be a positive integer or 'auto'")
    return threads, "asked for"


def load_target(path: str | Path, *, device: torch.device, dtype: torch.dtype,
                quantize: str | None = None, progress: bool = True, policy: KernelPolicy | None = None,
                comm: Communicator = SINGLE) -> Target:
    """Load an HF-format K2-family checkpoint directory, streaming shard by shard. ``policy``: the kernel
    policy (None: the environment's). ``comm``: the tensor-parallel group; each rank reads only its parts
    (parallel/shard.py), rank 0 shows the progress."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    cfg = ModelConfig.from_pretrained(path)
    scheme = checkpoint = checkpoint_scheme(path, cfg)
    on_load = False
    if quantize not in (None, "none", "w4a16"):
        raise BadInput(f"quantize={quantize!r} must be 'none' or 'w4a16'")
    tp = comm.world_size > 1
    if quantize == "w4a16":
        if isinstance(checkpoint, Fp8Scheme):
            log.info("dequantizing the FP8 checkpoint while loading (linears other than the routed experts "
                     f"in {str(dtype).removeprefix('torch.')})")
        elif checkpoint is not None:
            raise QuantError(f"{path}: the checkpoint is already quantized; drop quantize='w4a16'")
        scheme = parse_quantization_config(k2_quantization_config(32))
        on_load = True
        log.info("quantizing routed experts to W4A16 (group 32) while loading")
    target = Target(cfg, dtype=dtype, device=device, quant=scheme, quantize_on_load=on_load, policy=policy,
                    comm=comm)
    t0, read = time.perf_counter(), 0
    stream = iter_checkpoint(path, cfg, progress=progress and comm.rank == 0, scheme=checkpoint,
                             select=target.shard_index if tp else None)
    if on_load and isinstance(checkpoint, Fp8Scheme):
        # FP8 weights dequantized (float32, on the device) as they stream in; the routed experts are then
        # quantized from those values, the other linears kept dense in the model dtype
        stream = dequantized_stream(stream, checkpoint.block, torch.float32, device)
    for name, tensor in stream:
        read += tensor.nbytes
        target.load_tensor(name, tensor)
    target.finish_loading()
    if tp:
        log_load(comm, str(path), target, read, time.perf_counter() - t0, device)
    prepare_int4(target, dtype)   # INT4 words in the order of their kernels, before any capture
    return target


def target_from_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], *, device: torch.device | str,
                        dtype: torch.dtype, comm: Communicator = SINGLE) -> Target:
    """Build a target from canonical-name tensors (e.g. a golden bundle); INT4 per cfg.quantization. ``comm``:
    the tensor-parallel group (this rank keeps its parts of the tensors)."""
    scheme = parse_quantization_config(cfg.quantization)
    target = Target(cfg, dtype=dtype, device=device, quant=scheme, comm=comm)
    return target.load_weights(weights.items())


def greedy_from_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], prompt_ids: list[int],
                        n_tokens: int, device: str | torch.device, dtype: torch.dtype) -> list[int]:
    """Greedy tokens (EOS ignored) of the engine on the given weights: what golden checks compare."""
    target = target_from_weights(cfg, weights, device=device, dtype=dtype)
    res = generate(target, prompt_ids, SamplingParams(max_tokens=n_tokens, ignore_eos=True))
    return res.token_ids


def load_drafter(path: str | Path, target: Target):
    """A DFlash drafter directory, checked against the target (DraftMismatchError when it does not fit)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"drafter directory {str(path)!r} does not exist")
    return DFlashDrafter.from_pretrained(path, target.cfg, dtype=target.dtype, device=target.device,
                                         policy=target.policy)


def serve_rank(comm: Communicator, args: dict) -> None:
    """A spawned rank > 0: build the engine's shard and follow rank 0's requests."""
    LLM(**args, comm=comm).serve()


def load_tokenizer(path: str | Path) -> TextTokenizer | None:
    """The directory's tokenizer (tokenizer.json or Kimi's tiktoken.model), or None when there is none."""
    return load_text_tokenizer(path)


class LLM:
    """A loaded model ready to generate.

    ``LLM()`` or ``LLM("demo")``: the embedded demo (``kdtree_engine/assets/demo/``, a 10M-parameter K2-architecture
    model trained on Python code) with its DFlash drafter and a DDTree budget of 16, the CLI's defaults.
    ``generate`` returns :class:`GenerationResult` objects whose ``text`` is the generated text only (the prompt
    is not included; ``token_ids`` likewise holds the generated ids only).
    """

    def __init__(self, model: str | Path | None = None, *, draft: str | Path | None = None,
                 spec: str | SpecConfig | None = None, budget: int | str | None = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, quantize: str | None = None, batch_invariant: bool = True,
                 progress: bool = True, eager: bool | None = None, threads: int | str | None = None, tp: int = 1,
                 comm: Communicator | None = None, cache_tokens: int | None = None,
                 memory_fraction: float | None = None, warm_up: bool | None = False,
                 tp_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """``model``: a checkpoint directory, or None / ``"demo"`` for the embedded demo (its drafter and budget
        16 unless ``draft`` / ``budget`` say otherwise). ``spec``: none | dflash | ddtree; None = ddtree with a
        drafter, else none. ``eager``: True = rounds driven from the host and every prompt forward eager; False = each
        round replayed from a CUDA graph (CUDA, a fixed budget); None = graphs where they apply (see
        ``speculative.decode.pick_round_mode``); unless True, short prompts' forwards replay from a CUDA graph per
        length bucket on one CUDA device (model/prompt_graph.py).
        ``batch_invariant`` and the ``KDTREE_*_BACKEND`` variables make the kernel policy of target and drafter.
        ``threads``: torch's CPU threads (process-wide): an int, ``"auto"`` (by the model's size on the CPU, as
        the CLI does) or None (torch's setting is left alone); see :func:`resolve_threads`. ``tp``: ranks of tensor +
        expert parallelism (docs/parallel.md): this process is rank 0 and spawns ranks 1..tp-1 (or joins the group
        torchrun started); ``comm``: the group of a rank > 0 (parallel/launch.py passes it). ``cache_tokens`` /
        ``memory_fraction``: the size of the target's latent cache pool, made once after the weights, in tokens or
        as a fraction of the free device memory (default: 0.9 of it on CUDA, 2 x max_position_embeddings on the
        CPU; the least over the ranks under tp; logged with the maximum context; see kdtree_engine/cache.py).
        ``warm_up``: run the start-up warm-up (kdtree_engine/warmup.py: every prompt-length bucket and the budget's
        verify width compiled before the first request, logged with its count and seconds); None = on CUDA only (what
        `kdtree serve` asks); False (the default) = not at start-up. ``tp_timeout_s``: at tp > 1, a collective that
        waits longer fails (a rank died or hangs); rank 0 keeps idle ranks waiting with a no-op message every fifth of
        it (parallel/keepalive.py)."""
        args = dict(model=model, draft=draft, spec=spec, budget=budget, device=device, dtype=dtype, quantize=quantize,
                    batch_invariant=batch_invariant, progress=False, eager=eager, threads=threads, tp=tp,
                    cache_tokens=cache_tokens, memory_fraction=memory_fraction)
        demo = model is None or str(model) == DEMO
        if demo:
            if not (DEMO_DIR / "config.json").exists():
                raise BadInput(f"the embedded demo model is missing ({DEMO_DIR})")
            model = DEMO_DIR
            draft = DEMO_DIR / "draft" if draft is None else draft
        method = spec.method if isinstance(spec, SpecConfig) else (spec or ("ddtree" if draft is not None else "none"))
        if demo and budget is None and method == "ddtree" and not isinstance(spec, SpecConfig):
            budget = DEMO_BUDGET
        # the settings are checked before anything loads (a drafting method without a drafter included)
        spec_config = resolve_spec(spec if isinstance(spec, SpecConfig) else method, draft, budget)
        self.policy = KernelPolicy.from_env(batch_invariant=batch_invariant)
        self.eager = eager
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.comm, self.workers = SINGLE, None
        self._batch: RankedScheduler | None = None   # tp > 1: the continuous batch the ranks follow, if open
        self._keepalive: KeepAlive | None = None     # tp > 1, rank 0: the guard of its messages
        if tp != 1 or comm is not None:
            self._join(tp, comm, spec_config, Path(model), args, tp_timeout_s)
        self.target = load_target(model, device=self.device, dtype=self.dtype, quantize=quantize, progress=progress,
                                  policy=self.policy, comm=self.comm)
        self.drafter = None if draft is None else load_drafter(draft, self.target)
        pool = self.target.init_cache_pool(tokens=cache_tokens, fraction=memory_fraction)  # after the drafter's weights
        if self.device.type == "cuda" and eager is not True and self.comm.world_size == 1:
            self.target.prompt_graphs = PromptGraphs(self.target, capture=True)
            log_once("prompt-graphs", f"prompt forwards of up to {MAX_BUCKET} tokens: replayed from a CUDA graph per "
                     f"length bucket (eager=True / --eager runs them eagerly)")
        self.spec = resolve_spec(spec_config, self.drafter, None)
        if self.drafter is not None and self.spec.method != "none":
            self.spec.resolve(self.drafter.block_size, self.target.cfg.vocab_size)  # the budget's bound, now
        self.tokenizer = load_tokenizer(model)
        log_choices(self.policy, self.device)
        n_params = sum(t.numel() for t in self.target.parameters()) + sum(t.numel() for t in self.target.buffers())
        chosen = resolve_threads(threads, n_params, self.device)
        if chosen is not None:
            torch.set_num_threads(chosen[0])
        self.threads = torch.get_num_threads()
        what = "the embedded demo" if demo else str(model)
        spec_text = self.spec.method + (f" budget {self.spec.budget}" if self.spec.budget is not None else "")
        why_threads = chosen[1] if chosen is not None else "torch's setting"
        thread_text = f"torch threads {self.threads} ({why_threads})"
        # the plain run's one INFO line for the load, with the cache pool and the maximum context it gives
        log.info("loaded %s: %.1fM parameters, %s %s, spec %s%s%s, latent cache pool %d tokens (%s), maximum context "
                 "%d tokens", what, n_params / 1e6, self.device.type,
                 str(self.dtype).replace("torch.", ""), spec_text,
                 "" if self.drafter is None else f" (drafter {draft})",
                 f", {thread_text}" if self.device.type == "cpu" else "", pool.total_tokens, pool.sizing,
                 pool.max_context)
        self.warm_up_report: WarmUpReport | None = None
        if (self.device.type == "cuda" if warm_up is None else warm_up) and self.comm.rank == 0:
            self.warm_up_report = self.warm_up()   # ranks > 0 follow its requests in serve()

    def warm_up(self, chunk: int | None = None) -> WarmUpReport:
        """Compile, before any request, what requests will launch (kdtree_engine/warmup.py); rank 0 of a
        tensor-parallel engine sends the warm-up requests to the other ranks like any request."""
        drafting = self.drafter is not None and self.spec.method != "none"
        shape = self.spec.resolve(self.drafter.block_size if drafting else 1, self.target.cfg.vocab_size)
        return run_warm_up(lambda ids, params, plain: self.run(ids, params, plain=plain),
                       vocab_size=self.target.cfg.vocab_size,
                       max_position_embeddings=self.target.cfg.max_position_embeddings,
                       free_tokens=self.target.pool().free_tokens, round_nodes=shape.max_nodes, device=self.device,
                       chunk=chunk, drafting=drafting)

    def _join(self, tp: int, comm: Communicator | None, spec: SpecConfig, model: Path, args: dict,
              timeout_s: float) -> None:
        """Become a rank of a ``tp``-rank engine (rank 0: spawn or join the others; a worker: ``comm``). What the
        ranks would refuse is refused here first: the budget, the model directory, sizes that do not divide."""
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise BadInput(f"tp={tp!r} must be a positive integer")
        if spec.budget == "auto":
            raise BadInput("budget='auto' times each round on the host, which differs between ranks: give a fixed "
                           "budget with tp > 1")
        if not model.is_dir():
            raise FileNotFoundError(f"model directory {str(model)!r} does not exist")
        cfg = ModelConfig.from_pretrained(model)
        check_divisible(cfg, tp, split_groups(cfg, parse_quantization_config(cfg.quantization)))
        if not timeout_s > 0:
            raise BadInput(f"tp_timeout_s={timeout_s!r} must be a positive number of seconds")
        if comm is None:
            self.comm, self.workers, self.device = start_ranks(tp, self.device, serve_rank, (args,), timeout_s)
            self._keepalive = KeepAlive(self._noop, timeout_s, self.device)
            atexit.register(self.close)
        else:
            self.comm = comm
            self.device = rank_device(self.device, int(os.environ.get("LOCAL_RANK", comm.rank)))

    def run(self, ids: list[int], params: SamplingParams, *, plain: bool = False,
            on_tokens: OnTokens | None = None, stoppable: bool = False) -> GenerationResult:
        """One request of token ids (``plain``: plain decoding whatever ``spec``). ``on_tokens`` gets each round's
        tokens; with ``stoppable`` its True ends the request after that round (else its return is ignored at
        tp > 1, and honoured at tp = 1 as the generation loop does). Tensor parallel: rank 0 sends the request to the
        other ranks first, then every rank runs it; a stoppable request also sends rank 0's verdict after each
        round (a small collective a round), so every rank leaves after the same one."""
        if self.comm.world_size == 1:
            return self._decode(ids, params, plain, on_tokens)
        if self._batch is not None and self._batch.open:
            raise BadInput("a continuous batch is open on this tensor-parallel engine (its ranks follow its steps): "
                           "close it (Scheduler.close) before generating one request at a time")
        check_prompt(self.target, ids)   # a request the ranks would refuse is refused before it is sent
        try:
            with self._guard():   # the request's collectives follow its message with no keep-alive between
                params = send_request(self.comm, Request(ids, params, plain, stoppable), self.device).params
                return self._decode(ids, params, plain, self._rank0_rounds(on_tokens, stoppable))
        except RuntimeError as e:
            if self.workers is not None:
                self.workers.report_dead()   # a worker died: its one line, and this process ends
            if not collective_error(e):
                raise
            raise RankFailure(f"a tensor-parallel collective failed ({str(e).splitlines()[0]})") from None

    def _guard(self) -> ContextManager[None]:
        """Rank 0's guard of a message and the work after it (parallel/keepalive.py)."""
        return unguarded() if self._keepalive is None else self._keepalive.guard()

    def _noop(self) -> None:
        """Rank 0, idle: the keep-alive message (inside an open batch, its form)."""
        send_noop(self.comm, self.device, in_batch=self._batch is not None and self._batch.open)

    def _rank0_rounds(self, on_tokens: OnTokens | None, stoppable: bool) -> OnTokens | None:
        """Rank 0's per-round callback at tp > 1: the caller's, its verdict sent to the ranks when stoppable."""
        if not stoppable:
            if on_tokens is None:
                return None
            return lambda tokens: on_tokens(tokens) and None   # its verdict is not acted on: no rank could follow

        def each_round(tokens: list[int]) -> bool:
            return send_round_verdict(self.comm, bool(on_tokens(tokens)) if on_tokens is not None else False,
                                      self.device)
        return each_round

    def _decode(self, ids: list[int], params: SamplingParams, plain: bool,
                on_tokens: OnTokens | None) -> GenerationResult:
        return generate(self.target, ids, params, spec="none" if plain else self.spec,
                        drafter=None if plain else self.drafter, on_tokens=on_tokens, eager=self.eager)

    def serve(self) -> None:
        """A rank > 0: run rank 0's requests (and its continuous batches, step for step) until it stops."""
        while (req := recv_message(self.comm, self.device)) is not None:
            if isinstance(req, BatchOpen):
                follow_batch(self.target, self.drafter, self.comm, self.device, req)
                continue
            verdict = (lambda _tokens: recv_round_verdict(self.comm, self.device)) if req.stoppable else None
            try:
                self._decode(req.prompt_ids, req.params, req.plain, verdict)
            except BAD_INPUT_ERRORS:
                continue   # rank 0 meets the same error and reports it

    def close(self) -> None:
        """Rank 0 of a tensor-parallel engine: stop the other ranks and leave the group (idempotent)."""
        if self.comm.world_size == 1 or self.comm.rank != 0:
            return
        if self._batch is not None and self._batch.open:
            self._batch.close()   # the ranks leave the batch before they are told to stop
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None
        comm, self.comm = self.comm, SINGLE
        if self.workers is not None:
            self.workers.closing = True
        try:
            send_stop(comm, self.device)
        except RuntimeError as e:   # a peer is gone already: nothing left to stop
            log.warning("tensor-parallel ranks not stopped cleanly: %s", str(e).splitlines()[0])
        if self.workers is not None:
            self.workers.close()
        leave()

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError("this model directory has no tokenizer (tokenizer.json or tiktoken.model); pass "
                                  "the prompt as token ids")
            # special tokens written in the text are their ids, and tokenizer.json's post-processor applies
            return self.tokenizer.encode(prompt, special=True, add_special_tokens=True)
        return [int(t) for t in prompt]

    def decode(self, ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids), skip_special=True)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None, *,
                 on_tokens: OnTokens | None = None, stoppable: bool = False) -> list[GenerationResult]:
        """Generate for one prompt or a list of prompts (text or token ids), one after another. ``on_tokens``:
        called with each round's tokens; ``stoppable``: its True ends the request after that round (see :meth:`run`).
        :meth:`generate_batch` runs a list of prompts concurrently instead."""
        params = params or SamplingParams()
        results = []
        for p in prompt_list(prompts):
            res = self.run(self.encode(p), params, on_tokens=on_tokens, stoppable=stoppable)
            res.text = self.decode(res.token_ids)
            results.append(res)
        return results

    # ---- continuous batching -----------------------------------------------------------------------
    def scheduler(self, token_budget: int | None = None, prefill_chunk: int | None = None) -> Scheduler:
        """A continuous batch (:class:`kdtree_engine.batch.Scheduler`) over this engine's target and drafter:
        ``token_budget`` rows per forward (None: ``DEFAULT_TOKEN_BUDGET``), ``prefill_chunk`` the prompt chunk
        (None: the target's default, as :meth:`generate`). Feed it with :meth:`submit`. Tensor parallel: every rank
        runs the batch's steps (:class:`~kdtree_engine.parallel.batch.RankedScheduler`); one batch at a time, open
        until closed (a new one closes the last, its requests ending "abort")."""
        budget = DEFAULT_TOKEN_BUDGET if token_budget is None else token_budget
        if self.comm.world_size == 1:
            return Scheduler(self.target, self.drafter, token_budget=budget, prefill_chunk=prefill_chunk)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise BadInput(f"token_budget={token_budget!r} must be a positive number of rows per forward")
        if self._batch is not None and self._batch.open:
            self._batch.close()
        self._batch = RankedScheduler(self.target, self.drafter, self.comm, self.device, token_budget=budget,
                                      prefill_chunk=prefill_chunk, guard=self._guard,
                                      on_failure=None if self.workers is None else self.workers.report_dead)
        return self._batch

    def submit(self, scheduler: Scheduler, prompt: Prompt, params: SamplingParams | None = None, *,
               plain: bool = False, on_tokens: OnTokens | None = None) -> BatchSequence:
        """Queue one request (text or token ids) on ``scheduler`` with this engine's spec (method and budget;
        ``plain``: plain decoding). ``on_tokens`` gets each round's tokens; its True ends the request ("abort")
        unless it ended there anyway. It runs as the scheduler steps; ``Sequence.result`` is set at its end (its
        ``text`` is not: :meth:`decode` it)."""
        spec = SpecConfig() if plain else self.spec
        return scheduler.submit(self.encode(prompt), params, spec=spec.method, budget=spec.budget,
                                on_tokens=on_tokens)

    def generate_batch(self, prompts: Prompt | Sequence[Prompt],
                       params: SamplingParams | Sequence[SamplingParams] | None = None, *, plain: bool = False,
                       token_budget: int | None = None, prefill_chunk: int | None = None) -> list[GenerationResult]:
        """Generate for a list of prompts concurrently, through one continuous batch (:meth:`scheduler`): their
        rounds share each target forward. ``params``: one for every prompt or one per prompt. Each result equals
        that prompt's :meth:`generate` run alone (the same tokens; a sampled request draws from its own seed),
        except with ``budget='auto'``, whose budgets the batch chooses by its load (greedy tokens still equal).
        Results in the order of the prompts, ``text`` decoded. Tensor parallel: every rank runs the batch."""
        batch = prompt_list(prompts)
        each = [params or SamplingParams()] * len(batch) if not isinstance(params, (list, tuple)) else list(params)
        if len(each) != len(batch):
            raise BadInput(f"params has {len(each)} entries for {len(batch)} prompts: give one, or one per prompt")
        sched = self.scheduler(token_budget, prefill_chunk)
        try:
            seqs = [self.submit(sched, p, sp, plain=plain) for p, sp in zip(batch, each)]
            sched.run()
        finally:
            if self.comm.world_size > 1:
                sched.close()   # the ranks leave the batch
        results = []
        for seq in seqs:
            res = seq.result
            res.text = self.decode(res.token_ids)
            results.append(res)
        return results


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string, or token ids) as a list of one; a list of prompts as it is."""
    single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
    return [prompts] if single else list(prompts)
