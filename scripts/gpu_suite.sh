#!/usr/bin/env bash
# The GPU tests and benchmarks as a few named suites; logs, junit xml and records go to $OUT/results (packed into
# $OUT/results.tar after every step). Run from the repository root on the GPU machine:
#
#   bash scripts/gpu_suite.sh [--dry-run] SUITE [ARG]
#
#   tests PART     the GPU tests (pytest -m gpu) of one part: bitwise | rounds | kernels
#   tests          every GPU test of the three parts in one pytest run, spread over worker processes (pytest-xdist:
#                  the tests are compile-bound, the device has the cores), so the whole set fits one device call
#   bench          the benchmarks the README cites: the demo's spec bench (held-out prompts, budgets 4..64, a
#                  plot; again on the selection before the near-copy rule), the K2 layer step, the decoding rounds,
#                  the W4A16 / MoE kernels
#   kernel FAMILY  one kernel family's GPU tests and bench: w4a16 | moe | mla | gemm | gemm_moonlight | router |
#                  tails | fp8 (the FP8 kernels' tests, every candidate config of the FP8 MoE and W8A16 at K2 shapes
#                  and of the BF16 MoE at Moonlight-16B's) | gemm_moonlight (Moonlight-16B's dense GEMMs, every tile)
#   quick          a first look: the small kernels' and the speculative GPU tests, a short demo spec bench
#   formats        the BF16 / FP8 weight formats: their kernels' GPU tests, spec == plain on BF16 and FP8 targets,
#                  the fused MoE and W8A16 bench at K2 shapes (bench/moe_formats.py)
#   moonlight      Moonlight-16B's decoding and verify steps, BF16 and INT4 (bench/moonlight.py)
#   k2             all 61 K2 layers as one rank of TP8 / EP8 holds them: whole rounds from one CUDA graph at 4K and
#                  64K context, their byte roofline and a round's kernels (bench/k2_model.py)
#   k2step         the K2 rank's decode step in one call: the GPU tests of its launch-saving kernels (split-K sums by
#                  each tile's last program, the router tail making a rank's routes, the MoE planned for them), the
#                  batched step from one graph (bench/batch_graph.py) and whole rounds at 4K (bench/k2_model.py)
#   batch          continuous batching: the bitwise batch-vs-solo GPU test (graph and eager batched steps), then
#                  throughput at 1 / 4 / 16 / 64 concurrent requests, plain vs DDTree with the load-aware budget, demo
#                  and K2 one rank (bench/batch.py), and the K2 rank's batched plain step replayed from one graph
#                  (bench/batch_graph.py)
#   ttft           time to first token: the prompt's GPU tests (prompt graphs == the eager forward, chunked == one
#                  forward, the prefill kernel, the prefill's peak memory), the demo's TTFT after its start-up warm-up
#   serving        the serving stage in one call: bit for bit (spec == plain, batch == solo, batch invariance, the
#                  prefill kernel and chunked prefill) over worker processes, the demo's TTFT after the warm-up, the
#                  demo's batching throughput
#   multi          several GPUs of one host (a kind of 2, 4 or 8 GPUs): tensor + expert parallelism on NCCL, TP-N's
#                  tokens against one GPU's (float32) and DDTree == plain at TP-N (bfloat16), eager and from CUDA
#                  graphs holding the collectives, on the demo and a random K2-shaped model (tests/gpu/test_tp_gpu.py);
#                  the K2 model with one real rank a GPU, plain and DDTree rounds from CUDA graphs (bench/k2_model.py)
#   multibatch     several GPUs: the K2 continuous batch over every GPU, one real rank each (rank 0's batches
#                  followed step for step): plain and 8-node trees at 1 / 4 / 16 / 64 requests (bench/batch.py --ranks)
#   long           long context (bench/long_context.py): K2 one-rank decode / verify steps at 4K-256K against the
#                  byte roofline, prefill tokens/s and TFLOP/s at 1K-32K (K2 and the demo), a 128K prompt's time to
#                  first token (K2, 61 layers), the demo's TTFT after its start-up warm-up
#
# Every step runs under a cap (seconds); the caps of one suite (one part of `tests`) sum to at most 570 s, so a
# suite fits one 10-minute device call. A capped pytest run gets SIGINT first, so it still writes its summary and
# junit xml. --dry-run prints the steps without running them. On a copy of the work tree whose git metadata is not
# the code's, set KDTREE_RECORD_COMMIT to the code's commit: the records name it (docs/environment.md).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# NVLink multicast stays off (NCCL, PyTorch's symmetric memory, NVSHMEM), for every program a suite starts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out/gpu}
RES=$OUT/results
DRY=0
if [[ ${1:-} == --dry-run ]]; then DRY=1; shift; fi
SUITE=${1:-}
ARG=${2:-}
SUITES="tests [bitwise|rounds|kernels], bench, kernel {w4a16|moe|mla|gemm|gemm_moonlight|router|tails|fp8}, quick, formats, moonlight, k2, k2step, batch, multi, multibatch, long, ttft, serving"
die() { echo "gpu_suite.sh: $*" >&2; exit 2; }

PYT=(python3 -m pytest -m gpu -p no:cacheprovider -v -rf --durations=15)
pack() { tar -C "$RES" -cf "$OUT/results.tar" . ; }
step() {  # step NAME SECONDS COMMAND...: NAME.log (and NAME.xml for pytest) under $RES
  local name=$1 secs=$2; shift 2
  echo "== $name (cap ${secs}s): $(printf '%q ' "$@")"
  (( DRY )) && return 0
  local t0=$SECONDS
  timeout -s INT -k 30 "$secs" "$@" > "$RES/$name.log" 2>&1
  echo "rc=$? in $((SECONDS - t0))s" >> "$RES/$name.log"
  tail -4 "$RES/$name.log"; pack
}
pytest_step() {  # pytest_step NAME SECONDS PYTEST ARGS...: the GPU tests with a junit xml beside the log
  local name=$1 secs=$2; shift 2
  step "$name" "$secs" "${PYT[@]}" --junitxml="$RES/$name.xml" "$@"
}
spec_bench() {  # spec_bench NAME SECONDS DIR [BENCH SPEC ARGS...]: the demo's spec bench, record and plot in DIR
  local name=$1 secs=$2 dir=$3; shift 3
  (( DRY )) || mkdir -p "$dir"
  step "$name" "$secs" python3 -m kdtree_engine.bench_spec --device cuda --out "$dir" --plot "$dir/spec-h200.png" "$@"
}

# ---- the GPU tests, by part (files and -k selections; every GPU test is in exactly one part) ----
tests_bitwise() {  # spec == plain bit for bit (random targets, the demo, its logits alone), placement, INT4 target
  pytest_step pytest-bitwise 270 tests/gpu/test_bitwise_gpu.py tests/test_moe_placement.py \
    -k "not demo_logits_alone"
  pytest_step pytest-bitwise-demo-logits 200 tests/gpu/test_bitwise_gpu.py -k demo_logits_alone
  pytest_step pytest-target 100 tests/gpu/test_target_gpu.py
}
tests_rounds() {  # device-resident and graph rounds, the speculative GPU tests, the round's own kernels
  pytest_step pytest-rounds 420 tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py \
    tests/gpu/test_long_context_gpu.py tests/gpu/test_paged_gpu.py tests/gpu/test_batch_gpu.py \
    tests/gpu/test_prompt_graph_gpu.py tests/gpu/test_tp_gpu.py
  pytest_step pytest-round-kernels 150 tests/gpu/test_accept_walk_gpu.py tests/gpu/test_row_select_gpu.py \
    tests/gpu/test_draft_attention_gpu.py
}
tests_kernels() {  # the layer kernels: W4A16 / MoE (Triton and fragment), attention, GEMM, router, tails
  pytest_step pytest-kernels-w4 300 tests/gpu/test_kernels_gpu.py tests/gpu/test_w4_frag_gpu.py
  pytest_step pytest-kernels-layers 270 tests/gpu/test_mla_attention_gpu.py tests/gpu/test_prefill_attention_gpu.py \
    tests/gpu/test_mla_slots_gpu.py \
    tests/gpu/test_batch_invariance_gpu.py \
    tests/gpu/test_router_gemm_gpu.py tests/gpu/test_fused_tails_gpu.py tests/gpu/test_formats_gpu.py \
    tests/gpu/test_ordered_sum_gpu.py
}

# ---- one kernel family: its GPU tests, then its bench ----
kernel_w4a16() {
  pytest_step pytest-w4a16 300 tests/gpu/test_kernels_gpu.py tests/gpu/test_w4_frag_gpu.py -k "not moe"
  step bench-kernels 90 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench-w4-frag-dense 180 python3 bench/w4_frag.py --no-moe --out "$RES"
}
kernel_moe() {
  pytest_step pytest-moe 300 tests/gpu/test_kernels_gpu.py tests/gpu/test_w4_frag_gpu.py tests/test_moe_placement.py \
    tests/gpu/test_fused_tails_gpu.py -k moe
  step bench-kernels 90 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench-w4-frag-moe 180 python3 bench/w4_frag.py --no-dense --out "$RES"
}
kernel_mla() {
  pytest_step pytest-mla 330 tests/gpu/test_mla_attention_gpu.py tests/gpu/test_prefill_attention_gpu.py \
    tests/gpu/test_draft_attention_gpu.py
  step bench-mla-attention 150 python3 bench/mla_attention.py --out "$RES"
  step bench-mla-merge 60 python3 bench/mla_merge.py --out "$RES"
}
kernel_gemm() {
  pytest_step pytest-gemm 240 tests/gpu/test_batch_invariance_gpu.py
  step bench-gemm 150 python3 bench/gemm.py --out "$RES"
  # one TP8 rank's split shapes (a decode step's), every candidate reduction and tile at 1 / 4 / 16 rows
  step bench-gemm-rank 170 python3 bench/gemm.py --shapes rank --ms 1,4,16 --sweep --sweep-ms 1,4,16 \
    --sweep-seconds 120 --no-rmsnorm --no-heads --out "$RES/rank"
}
kernel_gemm_moonlight() {  # Moonlight-16B's dense linears (its BF16 decode step's largest kernel time), every tile
  step bench-gemm-moonlight 200 python3 bench/gemm.py --shapes moonlight --ms 1,4,16 --sweep --sweep-ms 1,4,16 \
    --sweep-seconds 140 --no-rmsnorm --no-heads --out "$RES/moonlight"
}
kernel_router() {
  pytest_step pytest-router 240 tests/gpu/test_router_gemm_gpu.py tests/gpu/test_fused_tails_gpu.py -k router
  step bench-router 120 python3 bench/router.py --out "$RES"
}
kernel_fp8() {
  pytest_step pytest-fp8 100 tests/gpu/test_formats_gpu.py -k "w8a16 or fp8 or graph_replay or split_k"
  step bench-moe-formats-sweep 300 python3 bench/moe_formats.py --sweep --rows 1,4,16 --out "$RES"
}
kernel_tails() {  # RMSNorm, SwiGLU, head norm + rope, the router tail: tests only (the K2 layer step times them)
  pytest_step pytest-tails 240 tests/gpu/test_fused_tails_gpu.py tests/gpu/test_row_select_gpu.py
}

# ---- the benchmarks the README cites ----
bench() {
  spec_bench bench-spec 150 "$RES" --budgets 4,8,16,32,64
  # the selection of the records made before the near-copy rule, beside them in the history
  spec_bench bench-spec-near-copies-kept 60 "$RES/near-copies-kept" --near-copies keep --methods none,ddtree --budgets 16
  step bench-k2-step 130 python3 bench/k2_step.py --timeline --time-budget 100 --out "$RES"
  step bench-round 120 python3 bench/round.py --budgets 16 --prompts 2 --out "$RES"
  step bench-kernels 100 python3 bench/kernels.py --no-sweep --out "$RES"
}

quick() {
  pytest_step pytest-quick 300 tests/gpu/test_row_select_gpu.py tests/gpu/test_accept_walk_gpu.py \
    tests/gpu/test_fused_tails_gpu.py tests/speculative/test_spec_gpu.py
  spec_bench bench-spec-quick 150 "$RES/quick" --num-prompts 2 --max-tokens 64 --budgets 8,auto
}

formats() {  # the BF16 / FP8 formats (docs/formats.md): kernel tests, spec == plain on BF16 and FP8 targets, the bench
  pytest_step pytest-formats 220 tests/gpu/test_formats_gpu.py
  pytest_step pytest-formats-bitwise 150 tests/gpu/test_bitwise_gpu.py -k "dense or fp8"
  step bench-moe-formats 150 python3 bench/moe_formats.py --out "$RES"
}

moonlight() {  # Moonlight-16B's shape, random weights: decoding and verify steps, BF16 and INT4 (docs/formats.md)
  step bench-moonlight 200 python3 bench/moonlight.py --out "$RES"
}

k2() {  # the whole K2 model at one rank's size (the parallelism issue's table)
  step bench-k2-model 400 python3 bench/k2_model.py --profile --out "$RES"
}

k2step() {  # the K2 rank's decode step: its kernels' GPU tests, then the step and whole rounds timed
  pytest_step pytest-step 200 tests/gpu/test_batch_invariance_gpu.py tests/gpu/test_fused_tails_gpu.py \
    tests/gpu/test_w4_frag_gpu.py -k "serial or moe_owned or planned_for_one or unowned"
  step bench-batch-graph-k2 80 python3 bench/batch_graph.py --model k2 --profile 1,16 --out "$RES"
  step bench-k2-model-4k 220 python3 bench/k2_model.py --contexts 4096 --nodes 1,8,16 --profile --out "$RES"
}

batch() {  # continuous batching (the batching issue): bit for bit against solo runs, then throughput
  pytest_step pytest-batch 160 tests/gpu/test_batch_gpu.py tests/gpu/test_mla_slots_gpu.py \
    tests/gpu/test_prefill_attention_gpu.py -k "batch or slots or whole_prompts"
  step bench-batch-demo 170 python3 bench/batch.py --model demo --methods plain,ddtree-auto,ddtree-auto-slots,ddtree-16 --repeats 5 \
    --host-profile 16 --out "$RES"
  step bench-batch-k2 180 python3 bench/batch.py --model k2 --methods plain,ddtree-auto,ddtree-auto-slots --max-tokens 64 \
    --repeats 2 --host-profile 16 --out "$RES"
  step bench-batch-graph-k2 60 python3 bench/batch_graph.py --model k2 --profile 16 --out "$RES"
}

multi() {  # several GPUs: tensor + expert parallelism on NCCL (the parallelism issue's multi-GPU point)
  (( DRY )) || nvidia-smi topo -m > "$RES/nvidia-smi-topo.txt" 2>&1 || true
  pytest_step pytest-tp 300 tests/gpu/test_tp_gpu.py
  # the K2 model on every GPU, one rank each, the collectives in the graphs: all 61 layers at 8 ranks; fewer
  # ranks hold bigger shards, so 12 layers there
  local gpus layers=()
  gpus=$( (( DRY )) && echo 8 || nvidia-smi -L 2>/dev/null | wc -l )
  (( gpus == 8 )) || layers=(--layers 12)
  step bench-k2-ranks 260 python3 bench/k2_model.py --ranks all ${layers[@]+"${layers[@]}"} --contexts 4096 \
    --nodes 1,8,16 --out "$RES"
}

multibatch() {  # several GPUs: K2 served to many requests at TP-N / EP-N (all 61 layers at 8 GPUs, else 12)
  local gpus layers=()
  gpus=$( (( DRY )) && echo 8 || nvidia-smi -L 2>/dev/null | wc -l )
  (( gpus == 8 )) || layers=(--layers 12)
  step bench-batch-k2-ranks 540 python3 bench/batch.py --model k2 --ranks all ${layers[@]+"${layers[@]}"} \
    --methods plain,ddtree-8 --max-tokens 64 --repeats 3 --out "$RES"
}

long() {  # the long-context issue's measurements, one record per step (each written after every measured row)
  step bench-long-steps 130 python3 bench/long_context.py --parts steps --label steps --out "$RES"
  step bench-long-prefill 170 python3 bench/long_context.py --parts prefill --prompts 1024,8192,32768 \
    --demo-prompt-sizes 1024,8192,32768 --profile --label prefill --out "$RES"
  step bench-long-ttft 120 python3 bench/long_context.py --parts prefill --prompts 131072 --no-demo-prefill \
    --label ttft-128k --out "$RES"
  step bench-long-demo 80 python3 bench/long_context.py --parts demo --label demo --out "$RES"
}

ttft() {  # time to first token (the long-context issue): the prompt's GPU tests, then the demo's TTFT after its
           # start-up warm-up (its prompts replayed from a graph per length bucket)
  pytest_step pytest-ttft 200 tests/gpu/test_prompt_graph_gpu.py tests/gpu/test_long_context_gpu.py \
    tests/gpu/test_prefill_attention_gpu.py
  step bench-long-demo 80 python3 bench/long_context.py --parts demo --label demo --out "$RES"
}

serving() {  # the serving stage's GPU checks and the records its docs cite, one device call
  pytest_step pytest-serving 300 -n "${GPU_TEST_WORKERS:-8}" tests/gpu/test_bitwise_gpu.py tests/gpu/test_batch_gpu.py \
    tests/gpu/test_batch_invariance_gpu.py tests/gpu/test_prefill_attention_gpu.py tests/gpu/test_long_context_gpu.py \
    -k "not demo_logits_alone"
  step bench-long-demo 80 python3 bench/long_context.py --parts demo --label demo --out "$RES"
  step bench-batch-demo 100 python3 bench/batch.py --model demo --methods plain,ddtree-auto,ddtree-16 \
    --host-profile 1,16 --out "$RES"
}

tests_all() {  # the files of every part in one run; timings are never asserted, so workers may share the GPU
  local files
  files=$(DRY=1; PYT=(python3 -m pytest); { tests_bitwise; tests_rounds; tests_kernels; } | sed -n 's/^== [^:]*: //p' \
    | tr ' ' '\n' | grep '^tests/.*\.py$' | sort -u | tr '\n' ' ')
  # shellcheck disable=SC2086
  pytest_step pytest-gpu 560 -n "${GPU_TEST_WORKERS:-8}" $files
}

run_suite() {
  case $SUITE in
    tests)
      case $ARG in
        "") tests_all ;;
        bitwise | rounds | kernels) "tests_$ARG" ;;
        *) die "unknown tests part '$ARG' (parts: bitwise, rounds, kernels)" ;;
      esac ;;
    bench | quick | formats | moonlight | k2 | k2step | batch | multi | multibatch | long | ttft | serving)
      [[ -z $ARG ]] || die "suite '$SUITE' takes no argument (got '$ARG')"
      "$SUITE" ;;
    kernel)
      case $ARG in
        w4a16 | moe | mla | gemm | gemm_moonlight | router | tails | fp8) "kernel_$ARG" ;;
        "") die "kernel needs a family (w4a16, moe, mla, gemm, router, tails, fp8)" ;;
        *) die "unknown kernel family '$ARG' (families: w4a16, moe, mla, gemm, gemm_moonlight, router, tails, fp8)" ;;
      esac ;;
    "") die "no suite given (suites: $SUITES)" ;;
    *) die "unknown suite '$SUITE' (suites: $SUITES)" ;;
  esac
}

if (( DRY )); then run_suite; exit 0; fi
( DRY=1; run_suite ) > /dev/null || exit  # a bad suite name fails here, before the machine is touched
mkdir -p "$RES"
nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
run_suite
ls -la "$RES"
