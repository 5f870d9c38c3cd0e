#!/usr/bin/env bash
# The GPU tests and benchmarks, logs and results packed under $OUT; one device call runs one part.
#   bash scripts/gpu_suite.sh [all|tune|check|bench|finish|w4|sweep|kcheck|final|probe|adopt|drafter|vsplit|close|next|chain|sample|rounds|decode|step|verify|resume|ncu|plane|merge|merge2|merge3|sample2|fork|last|plane2|rows|kload|lazy|rounds2|maxnreg|qsplit|stages|down|bm8|m64|merge4|merge5|final2|moerows|moe16|moe16b|router|router2|router3|final3|frag|frag2|frag3|frag4|frag5|frag7|frag8|xsm|xsm2|xsm3|xsm4|xsm5|xsm6|router4|arrive|tune2|direct|epi|pdl|pdl2|pdl3|rgemv|rgemv2|pdl4|pdl5|shared|final4|spec4|prof|round5|round6|round7|tiled|tiled2|tiled3|tiled4|tiled5|tiled6|tiled7|tiled8|wg|wg2|wide|wg3|wg4|wg5|ring|router5|wide64|wg8|wg8b|warps8|final5|moe8|small|small2|small3|small4|small5|take|chunk|wgdec|wgdec2|wgfin|wgfin2|wgprof|wgq|wgref|wground|ncuw4|tma|tma2|gsweep|wgtest|wgslice|wgslice2|slicefin|wgpipe|ncutree|wgqs2|wgfin3|wgbench|tailmerge|ltile|stream|stream2|stream3|streamfin|ncumoe|moestream|moestream2|chunks|chunks2|pairs|pairs2|pairs3|prefetch|bounds|fuse|fuse8|rside|rside2|final6|review2|ahead|stalls|heads|tline|tail|final7|final7b|stail|route|order|final8|final8b|rounds8|rstep|window|ctx|tailvs|vwg|vwg2|vwg3|vwg4|vwg5|vwg6|moegrid|stile|stile2|stile3|stile4|rwarps|review|pf|early|early2|srcstall|again|l2|clocks|bf16x3|rside3|final9|final9b|before3|wgasync]   (on the GPU machine, from the repository root)
#   tune   the W4A16 config sweep, the bitwise and CUDA-graph GPU tests, the demo's spec benchmark
#   check  the remaining GPU tests (kernels, batch invariance, target, attention), kernel and round benches
#   bench  the benchmarks with long runs (K2 step, attention, GEMM)
#   finish the GPU tests that need the most compile time (demo pair bitwise, graph rounds, target, kernels
#          at K2 shapes) and the round benchmark
#   w4     the W4A16 candidate sweep, the kernel GPU tests and the default-config kernel benchmark
#   sweep  the W4A16 and MLA attention candidate sweeps and the attention GPU tests
#   kcheck the kernel and batch-invariance GPU tests, the kernel and K2-step benchmarks
#   final  the bitwise, graph-round and target GPU tests, the round and demo spec benchmarks
#   probe  the W4A16 candidate sweep, a per-kernel profile of one K2 layer, the demo spec bench on 32 prompts
#   adopt  the kernel and batch-invariance GPU tests, the kernel, K2-step (with its profile) and demo spec benches
#   drafter the decode V_SPLIT attention sweep and its invariance test, the fused-tail tests (drafter head
#          norm + rope), the round and demo spec benches
#   vsplit the bitwise GPU tests, the attention invariance tests, the attention and K2-step benches
#   close  the demo's greedy spec == plain GPU test
#   next   the round bench with the engine's defaults (batch invariance on) and the two GPU tests whose
#          compile time outran their step caps (graph rounds with Triton attention, demo logits alone)
#   chain  the demo spec benches (8 and 32 prompts) with the DFlash chain cut to each budget, DDTree
#          budget auto against fixed budgets (eager rounds), the graph-vs-plain spec GPU test
#   sample sampled rounds in CUDA graphs: their GPU test, the demo spec bench at temperature 0.7 replayed
#          and eager
#   rounds every graph-round and spec GPU test, then the demo's greedy spec == plain bitwise test
#   decode the decode re-tiling (16-row tiles for T = 1, row sums by the MMA): its attention sweep and
#          bit-equality GPU tests, the demo's bitwise spec == plain, the attention bench
#   step   the K2 layer step (with its profile) and the round benchmark on the current defaults
#   verify the bitwise, batch-invariance and target GPU tests on the current defaults
#   resume sampled graph rounds with per-request temperature / top-p (their GPU tests and bench), then the
#          demo's logits-alone bitwise test with a cap long enough for its compiles
#   ncu    Nsight Compute sections (stall reasons, occupancy, memory) of one launch of each kernel case
#          (bench/ncu_probe.py), then the sampled graph-round GPU tests
#   plane  the nibble-plane W4A16 kernel against the default dense kernel at K2 shapes
#   rows   decode rows per program (MLAConfig.DECODE_ROWS): sweep, bit-equality tests, the demo's spec == plain
#   kload  the attention's key loads without masks, 32-bit offsets: bench, re-tiling sweep (decode warps,
#          TMA key tiles, rows per program), bit-equality tests, the demo's spec == plain
#   lazy   the rescale skipped where no row's max moved: sweep, bit-equality tests; the K2 layer step
#   rounds2 the round benchmark (eager vs graph, defaults) and the demo's logits-alone bitwise test (long compile)
#   maxnreg MoE register caps (MoEConfig.MAXNREG13 / MAXNREG2): sweep and same-bits GPU tests
#   qsplit the latent scores in two MMA chains (MLAConfig.QK_SPLIT 2, the default when it ran): bench, sweep against
#          one chain, attention bit-equality / reference tests, the demo's spec == plain, target tests
#   stages decode pipeline depth (MLAConfig.DECODE_STAGES 2; 2 past one wave of programs, removed since): sweep, bit-equality tests of
#          every decode re-tiling and the default configs, the demo's spec == plain, target tests
#   down   the MoE down GEMM split over I (MoEConfig.SPLIT_K2): sweep, the MoE GPU tests
#   bm8    8-token MoE expert blocks (mma.sync on sm_90): sweep, the MoE GPU tests (bits against 16-token blocks)
#   m64    W4A16 / MoE with the tokens on M in 64-row wgmma tiles (dequantized B operand read from shared
#          memory): sweep, the config-variant and batch-invariance GPU tests
#   merge4 the attention's chunk merge alone: bit-neutral launch variants (column tile, warps, PREFETCH)
#   merge5 the decode merge launch from that sweep (16 columns, one warp, prefetch): merge and attention benches,
#          attention bit-equality tests, the demo's spec == plain and the graph rounds with Triton attention
#   moerows the MoE align kernel (one program per expert) and the shared expert beside the routed ones: the
#          expert block rows sweep at T = 32..512, the MoE GPU tests, the K2 layer step with its profile
#   moe16  16-row expert blocks up to 12 pairs per expert: their same-bits and MoE tests, the kernel and K2
#          layer benches, the bitwise tests
#   moe16b the demo's greedy spec == plain, the round benchmark and the graph-round / spec GPU tests (the shared expert forked in captured rounds)
#   router the router's fp32 GEMM tiles (bench/router.py), the K2 step at T = 1 / 16 with the rank MoE's profile
#   router2 the router's fp32 tiles adopted: router bench, fp32 batch-invariance and fp32 graph-round tests, K2 step
#   router3 the router bench with the kernels of one call per M (where its time goes)
#   frag   the fragment-ordered W4A16 kernels (Gluon, weights straight into mma.sync registers): their GPU
#          tests and bench/w4_frag.py (dense and K2 MoE against the defaults)
#   frag2  the engine on the fragment kernels: their GPU tests, the demo's greedy spec == plain and the
#          device-length attention bitwise tests, the target tests, the round benchmark
#   frag3  the W4A16 kernel bench (frag and Triton), the MoE block sweep to T = 1024, the K2 layer step
#   frag4  the final code of the fragment round: fragment GPU tests (with the demo on them), the demo's
#          greedy spec == plain, graph rounds, the MoE kernel GPU tests, the W4A16 kernel bench
#   frag5  the GPU tests frag4's caps cut (sampled graph rounds, spec), the demo spec bench on the fragment MoE
#   frag7  the down GEMM's own tiles per warp (FragMoEConfig.MT2): fragment GPU tests, MoE candidates
#   frag8  the fragment GPU tests and the demo's greedy spec == plain after the kernel tidy-up
#   xsm    fragment kernels with the activations loaded 16 bytes per thread and relabelled through shared
#          memory: dense and MoE candidates
#   xsm2   the same with per-GEMM activation loads and a one-program align: fragment and align GPU tests,
#          candidates, the kernel bench, Nsight Compute on the T = 1 fragment MoE
#   xsm3   SwiGLU in the down GEMM's loads: fragment GPU tests, MoE candidates, the kernel and K2-step benches
#   xsm4   the final code: fragment and align GPU tests, the demo's greedy spec == plain, the target tests, the
#          kernel and round benches
#   xsm5   the final code: the demo spec bench, the graph-round and spec GPU tests
#   xsm6   two blocks of the down GEMM's words in flight (FragMoEConfig.DEPTH2 at 1ba8139, dropped): GPU tests, candidates
#   arrive the last-program epilogues at bca9951 (split-K sum, SwiGLU, top-k sum; dropped): their GPU tests, the
#          fragment candidates against the previous commit's (.abbase, an export of f81f08e), the kernel bench,
#          the other fragment GPU tests
#   tune2  fragment candidates: down-kernel register caps, split down GEMM, epilogue launch widths; dense tiles,
#          splits and 8-warp programs
#   direct (at 00d5eb9, dropped) one token's MoE blocks read from the ids (no align launch), the gate/up register cap, 256-wide
#          SwiGLU / top-k sum launches: fragment GPU tests, candidates, kernel bench, demo spec == plain, rounds
#   epi    the final code (256-wide SwiGLU / top-k sum launches, the direct blocks dropped): fragment GPU tests,
#          kernel bench, fragment candidates, the demo's spec == plain
#   pdl    programmatic dependent launches of the fragment GEMMs and their epilogue launches: fragment GPU tests
#          (same bits with and without, fresh inputs in graph replays), candidates, kernel bench, demo spec == plain
#   pdl2   pdl with the align launch a dependent too: fragment GPU tests, kernel bench, demo spec == plain,
#          candidates, align GPU tests, the K2 layer step and the round bench
#   pdl3   dependent launches of the batch-invariant GEMM and its split sum too: its GPU tests (bits, fresh
#          inputs in graph replays), the demo's spec == plain, the K2 layer step, the target tests, fragment tests
#   rgemv  the router kernel with the gate block in registers (kernels/router_gemm.py): its GPU tests, the router
#          bench, the demo's spec == plain, the target tests, the K2 layer step
#   rgemv2 the router kernel's one-warp programs with the next token's activations in flight: its GPU tests
#          (every candidate shape), the router bench
#   pdl4   the router kernel's table shape (one warp, 4 x 512) and dependent launches of the per-layer tails
#          (RMSNorm, residual + RMSNorm, rope, latent write, router tail, SwiGLU, attention chunks and merge):
#          router and tail GPU tests, the router bench, the demo's spec == plain, graph rounds, the K2 layer step
#   pdl5   the same code: the round bench, the target tests, the attention GPU tests
#   shared the K2 layer step with the shared expert beside / after / before the routed experts
#          (KDTREE_MOE_SHARED), and with the previous router GEMM path (bi_linear on x.float())
#   final4 the shared expert before the routed experts (default): the demo's spec == plain, the K2 layer step
#          with its profile, the round bench; the column-slice sweep of small verify attention launches
#   spec4  the demo spec bench on the final code (every setting checked lossless against plain decoding)
#   prof   the round bench with its per-kernel table of graph rounds (plain, DFlash, DDTree-16)
#   round5 the round's own kernels (drafter attention, row select, accept walk): their GPU tests, the demo
#          spec bench (every setting checked lossless), the round bench with its kernel table, spec == plain
#   round6 every graph-round and spec GPU test (greedy and sampled rounds through the accept walk kernel),
#          the demo spec bench on 32 held-out prompts
#   tiled  dense W4A16 words and scales in 64-row tiles (frag_tile): same-bits GPU tests, the dense fragment
#          candidates at M = 1 / 4 / 16
#   tiled2 the engine's dense W4A16 on 64-row tiled words: every fragment GPU test, the target GPU tests
#          (INT4 goldens), the dense fragment candidates, the kernel bench
#   tiled3 the experts' words tiled too: every fragment GPU test, the target GPU tests, the MoE fragment
#          candidates, the kernel bench, the K2 layer step with its profile
#   tiled4 64-row tiles against block-major words (frag_tile -1): same-bits GPU tests, the dense and MoE
#          fragment candidates
#   tiled5 the final code's GPU tests: fragment kernels, target, the demo's spec == plain, graph rounds and spec
#   tiled6 the final code's benches: the kernel bench, the K2 layer step, the demo spec and round benches
#   tiled7 the graph-round and spec GPU tests that tiled5's step cap left out (sampled rounds, tree builders, spec)
#   tiled8 every fragment GPU test after the word-pointer tidy-up (scales' pointers out of the TILE branch)
#   wg     the dense fragment kernel on wgmma (weights the register A operand, activations in shared memory):
#          its reference and batch-invariance GPU tests, the dense fragment bench at M = 1 / 4 / 16 / 64
#   wg2    the plan with wgmma programs beyond 16 tokens: every fragment GPU test, the dense bench up to M = 256
#   wg3    dense INT4 linears on the fragment kernel by default: its engine and plan GPU tests, the target and
#          demo spec == plain tests, the kernel bench
#   wg4    MoE expert blocks of 32 / 64 tokens on wgmma: the MoE fragment GPU tests, the MoE bench to T = 2048
#   wg5    the final code's fragment, target and demo spec == plain GPU tests (32-row wgmma blocks in the table)
#   ring   (commit a9e851d, dropped) words and scales through a shared-memory ring (cp.async): the ring GPU tests
#          (reference, same bits), the dense (M = 1 / 4 / 16) and MoE (T = 1 / 4 / 16 / 64) ring candidates
#   router5 the router GEMM on tensor cores (tf32x3 tiles): its GPU tests and bench; dense wgmma programs of two
#          warpgroups; 64-row 8-warp attention tiles at N = 64 (verify and decode shapes)
#   wide64 64-row 8-warp attention tiles as the N = 64 default: the N = 64 wide sweep (verify and decode), the
#          attention bit-equality / reference tests at N = 64, the K2 layer step
#   wg8    dense 64-token wgmma programs of two warpgroups and N = 64 attention verify tiles of 64 rows (decode
#          keeps 32): every fragment GPU test, the N = 64 attention tests, the attention bench
#   wg8b   the same code: the N = 64 V_SPLIT test, the K2 layer step with its profile and the kernel bench
#   warps8 the attention wide sweep with 8-warp 32 / 16-row verify tiles (no register spills offline), both N
#   final5 the final code: the attention bit-equality / batch-invariance tests of the default configs (both N
#          buckets), the INT4 target tests and the demo's greedy spec == plain
#   moe8   MoE wgmma blocks in two warpgroups: the MoE fragment tests that cover them, the MoE bench at prefill
#   take   row gathers of the device round by the elementwise index kernel (take_rows): the round benchmark, the graph
#          round and spec GPU tests, the demo's greedy spec == plain (first run as `rows`, a name already taken: that
#          call ran both parts)
#   chunk  CHUNK 256 against each N's default (--sweep-chunk, both N), then the round benchmark (token embeddings by
#          take_rows)
#   wgdec  the warpgroup decode kernel (mla_decode_wg.py, DECODE_WG): its bit-equality GPU tests against the chunk
#          kernel, the decode sweep at N = 8 (--sweep-rows)
#   wgdec2 the warpgroup kernel also for the prefix chunks of small trees and for N = 64 (row groups): its
#          bit-equality tests (decode, small trees), the small-tree and decode sweeps
#   wgfin  the warpgroup decode kernel as the default of both N buckets: the K2 layer step, the attention bench,
#          the demo's greedy spec == plain and the device-length attention bitwise test
#   wgfin2 the same code: the attention bit-equality / batch-invariance tests of the defaults, the graph rounds
#          with Triton attention
#   wgprof where a K2 layer's time goes at 1 / 4 / 8 nodes on that code (the K2 step with its per-kernel profile)
#   wgq    the warpgroup kernel with its first key tiles issued before q is read: its bit-equality tests, the N = 8
#          decode sweep
#   wgref  the decode-row checks of the attention GPU tests in one helper: the tests that use it
#   wground the final code: the round benchmark, the graph-round and spec GPU tests
#   tma    the dense fragment kernel with its words in 16-byte quarters (v4) and with a TMA-fed ring: their
#          same-bits GPU tests and the dense candidates of the fragment bench (v4 measured equal, removed since)
#   tma2   the TMA-fed ring: its same-bits GPU test and its dense candidates (measured slower, removed since)
#   gsweep the warpgroup decode kernel as the default against the reference and under CUDA-graph replays (K2
#          widths); the batch-invariant GEMM's reductions up to 8 splits for the K2 layer's small dense linears
#   wgtest the warpgroup default's reference and graph-replay GPU tests (fixed to launches that run as decode
#          launches)
#   wgslice column slices for one-query warpgroup launches at N <= 16 (DECODE_WG_MIN_PROGRAMS): the attention
#          bit-equality / batch-invariance and warpgroup tests, the graph-replay tests, the N = 8 decode sweep
#   wgslice2 the same with DECODE_WG_MIN_PROGRAMS inert (not refused) without DECODE_WG: the attention tests again,
#          the K2 layer step at 1 / 4 nodes
#   slicefin the final code (one slice-doubling helper for both decode rules): the attention bit-equality /
#          batch-invariance and warpgroup tests, the graph-replay and device-length tests, the demo's spec == plain
#   wgpipe the warpgroup launches' next-block scores issued early (DECODE_WG_PIPE), 8/16-row programs
#          (DECODE_WG_ROWS), column slices of small trees' prefix launches: bit-equality tests, the --sweep-wg
#          attention sweep, the K2 layer step at 1 / 4 / 8 nodes, Nsight Compute of the 32K decode
#   wgqs2  the warpgroup launches with the scores in two chains (QK_SPLIT 2) and 8/16-row programs: bit-equality
#          tests, the --sweep-wg attention sweep, then Nsight Compute of small trees' launches (part ncutree)
#   wgfin3 the defaults with sliced tree prefixes, 16-row programs at N <= 16 and DECODE_MIN_PROGRAMS 64 at N = 64: the
#          attention bit-equality / batch-invariance and reference tests, graph-replay / device-length tests, the
#          demo's spec == plain
#   wgbench the same defaults: the K2 layer step and the attention bench
#   tailmerge the merge's launch variants at small trees' rows (bench/mla_merge.py) and the tree-tail launch's tiles
#          (--sweep-small)
#   ltile  the warpgroup kernel's row sums carried as the ones-MMA's tile (one cross-warp reduction per block fewer):
#          warpgroup / small-tree / batch-invariance tests, Nsight Compute of the 32K decode, the N = 8 --sweep-wg
#          sweep, the demo's spec == plain, the K2 layer step at 1 / 4 / 8 nodes
#   stream the dense fragment W4A16 kernel on a stream partition (one wave of programs, tiles cut inside): the
#          dense fragment GPU tests, the dense candidates of bench/w4_frag.py at M = 1..256
#   stream2 the same with the partials' sum on column tiles (32-bit column arithmetic), fewer candidates
#   stream3 the kernel benchmark on the stream partition (bench/kernels.py)
#   streamfin the dense fragment GPU tests after the review commit (the engine's plan checked at K2 shape)
#   ncutree Nsight Compute of the attention's launches for small trees over 4K (N = 8 and 64) and the N = 64 decode
#   ncuw4  Nsight Compute sections of the engine's dense fragment W4A16 kernel at M = 4 and 16 (36864 x 7168)
#   ncumoe Nsight Compute sections of the fragment MoE launches at T = 1 and 4 (K2 experts, engine word order)
#   moestream the MoE fragment kernels on their stream partitions: their GPU tests, the MoE candidates of
#          bench/w4_frag.py, Nsight Compute at T = 1 / 4
#   moestream2 the same tests and candidates after the down GEMM's whole tiles, the kernel bench, the K2 step
#   chunks the fragment GPU tests, bench/w4_frag.py (the engine's plans and row-major words) and the kernel bench
#          on chunk-major tiled words (frag_chunks), Nsight Compute of the dense kernel at M = 4
#   chunks2 the tiled-word and demo fragment tests, then the INT4 target tests and the demo's spec == plain
#   pairs  the dense fragment GPU tests and bench/w4_frag.py's dense plans with and without two blocks per trip
#   pairs2 the dense fragment GPU tests again (two blocks per trip at one MMA tile per warp only), the kernel bench
#   pairs3 after the loop's one-block steps were shared by both loops: the dense and MoE fragment tests, the
#          kernel bench, the INT4 target tests
#   fuse   the MoE's SwiGLU and top-k sum in the GEMMs' last programs (arrival counters) for launches of up to 64
#          pairs: the MoE fragment GPU tests (the same bits as the launches), the kernel and K2 layer benches, the
#          INT4 target tests and the demo's spec == plain
#   fuse8  the fused MoE epilogues for one token only: the fused / batch-invariance / graph MoE tests, the kernel,
#          K2 layer and launch-bound benches, the demo's spec == plain
#   rside  the router on a side stream beside the shared expert (KDTREE_MOE_SHARED=router-side): the placements'
#          same-bits GPU test, the K2 layer with and without (results under before/ and rside/)
#   rside2 router-side as the default up to 8 tokens (before beyond): the placements' GPU test, the K2 layer step, the
#          INT4 target tests and the demo's spec == plain
#   final6 the graph-round and spec GPU tests on the final code (fused one-token MoE epilogues, router-side)
#   review2 after the review (one helper for the down program's arrival): the fused-epilogue and graph MoE tests
#   ahead  the warpgroup attention with the next key block's scores issued before the softmax: its bit-equality
#          GPU tests and the warpgroup sweep
#   stalls the warpgroup attention's stall reasons (Nsight Compute PC sampling: 32K decode at N = 8, a 4-node tree over
#          4K at N = 64), its bit-equality tests with one wait per block, the attention bench
#   heads  the per-head GEMM's tile sweep (the MLA absorption products) and 16-token dense W4A16 as two 8-token programs
#   tline  the per-head GEMM's batch-invariance tests on its new tiles, the K2 layer at 1 / 4 / 8 nodes with the
#          kernel timeline of one layer inside its CUDA graph
#   tail   the tree-tail attention launch in column slices (TAIL_V_SPLIT): its bit-equality tests, the small-tree sweep
#   final7 this round's final code (one wait per attention key block, the committed length read as it is, the per-head
#          GEMM tiles): attention bit-equality and device-length tests, graph-round and spec tests, the demo's spec ==
#          plain, the K2 layer (with its timeline) and attention benches
#   final7b the GPU tests final7's step caps cut off (the last small-tree attention cases, the spec tests)
#   stail  N = 64 small trees' tail launch in 16-row 8-warp tiles (the default now): their bit-equality tests, the K2
#          layer at 1 / 4 / 8 nodes with its timeline
#   route  the shared expert added in the routed experts' top-k sum and the tensor-core router GEMM (commit ab1fa1d,
#          reverted since: KDTREE_ROUTER_GEMM=tc is gone): their GPU tests, the router bench (its tensor-core
#          candidates), the K2 layer with its timeline on the FMA router and the K2 layer with the tensor-core router
#   order  a tree's tail attention launch issued before its prefix launch (mla_attention.TAIL_FIRST of commit 2ed5474,
#          dropped since: the python one-liner step no longer applies): the small-tree,
#          V_SPLIT-by-T and device-length bit-equality tests, the merge bench (large-tree shapes and wider column
#          tiles), the K2 layer with its timeline, and again with the prefix launch first
#   final8 this round's final code (the shared expert added in the routed top-k sum, the router GEMM's split partials
#          summed by the router tail): the router, MoE placement and fragment-addend GPU tests, the INT4 target tests,
#          the demo's spec == plain and the device-length bitwise test, the K2 layer with its timeline
#   final8b the graph-round and spec GPU tests on the same code
#   rounds8 final8b's tests, then the K2 layer timed on graphs of 4 layer calls (--graph-rounds 1) and of 16 (4)
#   rstep  the router GEMM's tokens side by side in a loop step (RouterGemmConfig.STEP of commit 0bb81c5, the same bits;
#          dropped since, the runpy step no longer applies): its GPU tests, the router bench, the K2 layer with the
#          table's STEP set to 4 and as it is
#   window the K2 layer's timeline at 1 / 4 / 8 nodes as it is, with the router GEMM in 8-row 4-warp programs
#          (RouterGemmConfig(8, 512, 4, 16): other bits) and with the shared expert's gate/up GEMM split over K in 2
#          (other bits), each set through runpy before the bench: the window of the router beside the shared expert
#   ctx    the K2 layer at a committed length that is not a multiple of the 512-key chunk (4000: a tree's tail launch
#          then holds 416 prefix keys besides the tree's) and at 4096, one after the other, with their timelines
#   tailvs a tree's tail launch in column slices (MLAConfig.TAIL_V_SPLIT of commit 542973e, dropped again since: the runpy
#          steps no longer apply) where the committed length is off the
#          chunk grid: the N = 64 bit-equality tests of the slices, the K2 layer at context 4000 with the N > 16
#          bucket's TAIL_V_SPLIT 0 / 2 / 4 (set through runpy) and their timelines
#   vwg    a tree's whole prefix chunks on the queries-on-M warpgroup kernel (MLAConfig.VERIFY_WG): its bit-equality
#          GPU tests, the attention sweep against the chunk kernel, the K2 layer at 16 / 32 / 64 nodes with the N > 16
#          bucket's VERIFY_WG 2 (set through runpy) and as it is, with their timelines
#   vwg2   VERIFY_WG 2 as the default of both buckets: the attention tests that run trees on the verify tiles (bit
#          equality, batch invariance, the reference), the demo's greedy spec == plain and the device-length bitwise test
#   vwg3   the same: the K2 layer with its timeline, the attention bench, the graph-round and spec GPU tests, the
#          attention tests with the scores in two chains (QK_SPLIT 2: the chunk kernel's verify tiles)
#   vwg4   the K2 layer three times in a row on the final code (the spread between calls), the last with its timeline
#   vwg5   after the two warpgroup kernels share their q load and key ring: both kernels' bit-equality GPU tests
#   vwg6   the verify kernel's bit-equality GPU tests, the verify sweep, the K2 layer at 16 / 32 / 64 nodes; run at commit
#          8581e26 (block j + 1's scores issued before block j's softmax, mla_verify_wg.SCORES_AHEAD: reverted since)
#   moegrid the MoE GEMM grids in the other launch order (FragMoEConfig.ORDER): its bit-equality GPU test, the MoE
#          candidates at T = 16 / 64 / 256 beside the launches over only the used blocks, Nsight Compute at T = 64;
#          run at commit f5c1d7d (ORDER removed since)
#   review after the review (the MoE kernel back on its one grid order, the tiles' reshape shared): the MoE fragment
#          GPU tests and the kernel bench
#   stile  the fragment kernels on scales in 64-row tiles (scale_tile, STILE): their bit-equality GPU tests, the dense
#          and MoE candidates beside the engine's row-major scales
#   stile2 the engine keeping its fragment-ordered INT4 scales in 64-row tiles too (int4_order, ENGINE_ORDER): the
#          fragment GPU tests (dense, MoE, the engine's dispatch), the INT4 target tests, the kernel bench, the K2 layer
#   stile3 the rest of stile2's fragment GPU tests (its file ran into the step cap), the demo's greedy spec == plain,
#          the device-length bitwise and demo graph-replay tests, the K2 layer again
#   early  the attention merge's first blocks loaded beside the row's length loads (EARLY): the merge bench's launch
#          variants (same-bits column), then the K2 layer's timeline with the engine's merge and with EARLY on
#   srcstall where the N = 8 decode at 32K, the 64-node tree at N = 64 over 4K and the 16-token dense fragment GEMM
#          stall, by instruction (Nsight Compute's source counters: the top stall locations of each kernel)
#   (ws, at commit 454de55 only: the verify warpgroup launches warp-specialized, MLAConfig.VERIFY_WS: the verify kernels'
#          bit-equality GPU tests, the verify sweep, the K2 layer at 16 / 32 / 64 nodes with and without it; bit-equal,
#          no faster: the part went with the kernel)
#   (rfma, at commit a0df80e only: the router GEMM on the FMA kernel with the generic GEMM's bits, kernels/router_fma.py: its
#          GPU tests, the router bench, the K2 layer with KDTREE_ROUTER_GEMM=fma and as it is; slower than the router
#          kernel: the part went with the kernel)
#   early2 the merge's EARLY loads in the engine's launches (merge_tiles): their bit-equality GPU test against EARLY off,
#          the attention decode / tree tests, the demo's greedy spec == plain and device-length bitwise tests, the
#          attention bench and the K2 layer
#   (group, at commit 0e8507b only: consecutive chunks grouped per warpgroup decode program, MLAConfig.DECODE_WG_MAX_PROGRAMS:
#          its bit-equality GPU tests, the chunk-length sweep at N = 8; bit-equal, no faster: the part went with the code)
#   again  the three target benches on the unchanged code in one lease: the kernel bench, the attention bench and the
#          K2 layer three times over (the spread within one machine)
#   l2     where the MoE GEMMs' L2 traffic comes from at 16 and 64 tokens (Nsight Compute: DRAM bytes, L2 sectors by source
#          and operation, the memory tables), the question being why an expert costs more time at 64 tokens
#   clocks the SM / memory clocks, power and throttle reasons sampled every 50 ms (nvidia-smi) while the kernel bench and
#          the K2 layer at 16 / 64 nodes run
#   bf16x3 the router GEMM on the tensor cores (the float32 gate as three bf16 parts, the default for bf16 activations):
#          the router bench, the K2 layer at 1 / 16 / 64 nodes with the FMA router and the default (alternating), the
#          router GPU tests, the target tests, the demo's greedy spec == plain and device-length bitwise tests
#   rside3 with the tensor-core router: the K2 layer at 16 / 32 / 64 nodes with the router beside the shared expert
#          (KDTREE_MOE_SHARED=router-side) and as it is (before it from 9 tokens), alternating
#   final9 this round's final code (the tensor-core router): the bitwise GPU tests but the demo's logits-alone one, the
#          MoE placements, the graph-round and spec GPU tests
#   final9b the K2 layer with its timeline on this round's final code (the tensor-core router)
#   before3 with the tensor-core router: the K2 layer at 1 / 4 / 8 nodes with the shared expert before the router
#          (KDTREE_MOE_SHARED=before) and as it is (the router beside it up to 8 tokens), alternating
#   wgasync the dense fragment kernel with one wgmma chain in flight (frag_linear mma 'wgmma-async', opt-in): its
#          same-bits and reference GPU tests, its candidates beside the engine's plan (bench/w4_frag.py --only async,
#          M = 1 .. 256), the offline compile report on the device's triton (bench/frag_aot.py)
#   (pf2, at commit 7c9777c only: the gate/up programs asking L2 for the down GEMM's first K blocks, FragMoEConfig.PF2)
#   (pairs13, at commit 177f263 only: the MoE K loops two blocks per trip, FragMoEConfig.PAIRS13 / PAIRS2)
#   pf     blocks of the fragment kernels' words and scales asked of L2 ahead of the one in use: candidates beside the
#          engine's plan / table (dense M = 1 / 4 / 16, MoE T = 1 / 4 / 16 / 64), then the same-bits GPU tests; run at
#          commits 28257c5 (a line per thread) and 0a4281b (one bulk prefetch per run), slower: reverted since
#   stile4 on the final code: the dense and MoE fragment kernels on the engine's tiled scales beside row-major scales
#          (bench/w4_frag.py), the K2 layer with its timeline
#   rwarps the router GEMM's programs of several one-warp row blocks (RouterGemmConfig.ROW_WARPS, the K2 table's from
#          16 tokens): the router GPU tests, the router bench, the K2 layer; run at commit 3927eec (other bits than one
#          warp, no faster: reverted since)
#   bounds what leaving out one launch could gain (bench/launch_bounds.py): the MoE's SwiGLU / top-k sum, a small
#          tree's tail launch beside its prefix launch
#   prefetch weight / key lines asked of L2 before the dependent-launch waits (commit 549eb2a, reverted since: its
#          --no-prefetch flags are gone): same-bits GPU tests, the K2 layer and kernel benches with and without
#   small5 the same code with the bench's candidates fixed: the attention bench, the V_SPLIT-by-T test (small trees on
#          the verify tiles there), the K2 layer step again
#   small4 N <= 16 small trees up to 16 nodes in 8 warps as the default: the K2 layer step, the attention bench, the
#          attention bit-equality tests, the INT4 target tests and the demo's spec == plain
#   small3 the small trees' own tiles (MLAConfig.SMALL_BLOCK_M / SMALL_WARPS) and DECODE_MAX_T 16 at N = 8: sweep and
#          bit-equality tests
#   small2 small trees on the decode tiles as the default, T = 1 device-length launches causal: attention bit-equality
#          tests, the INT4 target tests and the demo's spec == plain, the K2 layer step, the small-tree sweep
#   small  trees of up to 8 nodes on the attention's decode tiles (MLAConfig.DECODE_MAX_T): sweep and bit-equality
#          test; the K2 layer step on the engine's static (device-round) forward, with its profile
#   wide   64-row verify tiles of the MLA attention (wgmma) against the defaults: time and bits (--sweep-wide)
#   round7 each DDTree-builder test case timed apart (scripts/diag_tree_gpu.py), then the graph-round tests
#          that round6's step cap left out and the spec GPU tests
#   router4 the router-logit kernel (kernels/router_gemm.py at 5f813f4, dropped): its GPU tests, the demo's spec == plain, the
#          router and K2-step benches, the target tests
#   final3 final2 on this round's final code (align kernel, expert block rows, forked shared expert, router tiles)
#   final2 the kernel, batch-invariance and bitwise GPU tests (all but the demo's logits-alone test) on the final code
#   plane2 the same with the weights as the MMA's B operand (mma.sync, tokens on M), and its Nsight Compute
#   merge  the attention merge by pairwise trees: attention GPU tests, attention bench, chunk-length sweep,
#          Nsight Compute of the 128K decode
#   merge2 the attention bit-equality GPU tests (default configs), the attention bench, the demo's greedy
#          spec == plain and the device-length / Triton-attention graph-round tests
#   merge3 merge2 on the final merge tiles, then the K2 layer step with its profile
#   sample2 the demo spec bench at temperature 0.7 (CUDA-graph rounds, per-request temperature / top-p)
#   fork   prefix and tree-tail attention launches side by side: attention bench, graph-round bitwise
#          tests, attention bit-equality tests
#   last   the round benchmark and the longest-compiling GPU tests (device-length attention, demo bitwise)
# Each step has its own time cap so one slow step cannot take the rest with it; the results tarball
# is rebuilt after every step (only a few files come back from the machine).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-out/gpu}
RES=$OUT/results
PART=${1:-all}
mkdir -p "$RES"
pack() { tar -C "$RES" -cf "$OUT/results.tar" . ; }
step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  echo "== $name (cap ${secs}s): $*"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$RES/$name.log" 2>&1; echo "rc=$? in $((SECONDS - t0))s" >> "$RES/$name.log"
  tail -4 "$RES/$name.log"; pack
}
PYT="python3 -m pytest -m gpu -p no:cacheprovider -v -rf --durations=10"
# the demo's greedy spec == plain and the device-length attention bitwise test (word-split on purpose)
SPEC_BITWISE="tests/gpu/test_bitwise_gpu.py::test_greedy_spec_equals_plain_demo tests/gpu/test_graph_round_gpu.py::test_device_length_attention_bitwise_gpu"
# the attention bit-equality / batch-invariance tests of the default configs
MLA_BITEQ="(batch_invariant or bit_equal) and not kom and not qil and not candidate"
NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
  --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
  --section InstructionStats --section SourceCounters"
target_and_spec() {  # the INT4 target tests, the demo's greedy spec == plain and the device-length bitwise test
  step pytest_target 120 $PYT tests/gpu/test_target_gpu.py
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
}
ncu_probe() {  # ncu_probe NAME SECONDS CASE [NCU OPTIONS...]: Nsight Compute on one bench/ncu_probe.py case
  local name=$1 secs=$2 case=$3; shift 3
  local ncu; ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  step "$name" "$secs" "$ncu" --clock-control none --profile-from-start off $NCU_SECTIONS "$@" \
    python3 bench/ncu_probe.py "$case"
}
nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
if [[ $PART == tune || $PART == all ]]; then
  step bench_kernels_sweep 175 python3 bench/kernels.py --sweep-only --sweep-budget 150 --out "$RES"
  step pytest_bitwise 185 $PYT tests/gpu/test_bitwise_gpu.py
  step pytest_graph 90 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
  step bench_spec 110 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --out "$RES" --plot "$RES/spec-h200.png"
fi
if [[ $PART == check || $PART == all ]]; then
  step pytest_kernels 200 $PYT tests/gpu/test_kernels_gpu.py tests/gpu/test_batch_invariance_gpu.py \
    tests/gpu/test_target_gpu.py tests/gpu/test_mla_attention_gpu.py
  step bench_kernels 60 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_round 45 python3 bench/round.py --out "$RES"
fi
if [[ $PART == bench || $PART == all ]]; then
  step bench_k2_step 200 python3 bench/k2_step.py --out "$RES"
  step bench_mla 80 python3 bench/mla_attention.py --out "$RES"
  step bench_gemm 90 python3 bench/gemm.py --out "$RES"
fi
if [[ $PART == w4 ]]; then
  step bench_kernels_sweep 230 python3 bench/kernels.py --sweep-only --sweep-budget 200 --out "$RES"
  step pytest_kernels 130 $PYT tests/gpu/test_kernels_gpu.py
  step bench_kernels 80 python3 bench/kernels.py --no-sweep --out "$RES"
fi
if [[ $PART == sweep ]]; then
  step bench_kernels_sweep 200 python3 bench/kernels.py --sweep-only --sweep-budget 150 --out "$RES"
  step bench_mla_sweep 170 python3 bench/mla_attention.py --sweep-only --no-peers --budget-s 110 --out "$RES"
  step pytest_mla 150 $PYT tests/gpu/test_mla_attention_gpu.py
fi
if [[ $PART == kcheck ]]; then
  step pytest_kernels 150 $PYT tests/gpu/test_kernels_gpu.py tests/gpu/test_batch_invariance_gpu.py
  step bench_kernels 60 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_k2_step 200 python3 bench/k2_step.py --out "$RES"
fi
if [[ $PART == final ]]; then
  step pytest_target 100 $PYT tests/gpu/test_fused_tails_gpu.py tests/gpu/test_target_gpu.py
  step pytest_bitwise 170 $PYT tests/gpu/test_bitwise_gpu.py
  step bench_round 100 python3 bench/round.py --prompts 2 --max-tokens 64 --budgets 32 --warmup-tokens 16 --batch-invariant off --out "$RES"
  step pytest_graph 120 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
  step bench_spec 95 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --out "$RES" --plot "$RES/spec-h200.png"
fi
if [[ $PART == probe ]]; then
  step bench_kernels_sweep 240 python3 bench/kernels.py --sweep-only --sweep-budget 200 --out "$RES"
  step bench_k2_profile 100 python3 bench/k2_step.py --nodes 1,16 --profile --out "$RES/profile"
  step bench_spec32 120 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 32 --max-tokens 128 \
    --out "$RES/spec32" --plot "$RES/spec32/spec-h200.png"
fi
if [[ $PART == adopt ]]; then
  step pytest_kernels 170 $PYT tests/gpu/test_kernels_gpu.py tests/gpu/test_batch_invariance_gpu.py
  step bench_kernels 80 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_k2_step 200 python3 bench/k2_step.py --profile --out "$RES"
  step bench_spec 95 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --out "$RES" --plot "$RES/spec-h200.png"
fi
if [[ $PART == drafter ]]; then
  step bench_mla_decode 100 python3 bench/mla_attention.py --sweep-only --sweep-decode --no-peers --budget-s 80 \
    --out "$RES"
  step pytest_tails 80 $PYT tests/gpu/test_fused_tails_gpu.py
  step pytest_mla_vsplit 130 $PYT tests/gpu/test_mla_attention_gpu.py -k "v_split_by_t and default"
  step bench_round 100 python3 bench/round.py --prompts 2 --max-tokens 64 --budgets 32 --warmup-tokens 16 --batch-invariant off --out "$RES"
  step bench_spec 95 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --out "$RES" --plot "$RES/spec-h200.png"
fi
if [[ $PART == vsplit ]]; then
  step pytest_bitwise 170 $PYT tests/gpu/test_bitwise_gpu.py -k "not demo_logits_alone"
  step pytest_mla 140 $PYT tests/gpu/test_mla_attention_gpu.py \
    -k "(v_split_by_t and default) or tree_batch_invariant_bf16 or causal_batch_invariant or bf16_vs_reference"
  step bench_mla 100 python3 bench/mla_attention.py --out "$RES"
  step bench_k2_step 90 python3 bench/k2_step.py --profile --out "$RES"
fi
if [[ $PART == close ]]; then
  step pytest_bitwise_demo 150 $PYT tests/gpu/test_bitwise_gpu.py -k "greedy_spec_equals_plain_demo"
fi
if [[ $PART == next ]]; then
  step bench_round 110 python3 bench/round.py --prompts 2 --max-tokens 64 --budgets 32 --warmup-tokens 16 --out "$RES"
  step pytest_graph_triton_attn 230 $PYT tests/gpu/test_graph_round_gpu.py -k triton_attention
  step pytest_bitwise_demo_logits 230 $PYT tests/gpu/test_bitwise_gpu.py -k demo_logits_alone
fi
if [[ $PART == chain ]]; then
  step pytest_spec 120 $PYT tests/speculative/test_spec_gpu.py
  step bench_spec 110 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --out "$RES" --plot "$RES/spec-h200.png"
  step bench_spec32 130 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 32 --max-tokens 128 \
    --out "$RES/spec32" --plot "$RES/spec32/spec-h200.png"
  step bench_spec_auto 150 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --eager --methods none,ddtree --budgets 8,16,32,64,auto --out "$RES/auto" --plot "$RES/auto/spec-h200.png"
fi
if [[ $PART == sample ]]; then
  step pytest_sampled 200 $PYT tests/gpu/test_graph_round_gpu.py -k "sampled or default_mode" tests/speculative/test_spec_gpu.py
  step bench_spec_sample 120 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --temperature 0.7 --budgets 8,16,32 --out "$RES/sample" --plot "$RES/sample/spec-h200.png"
  step bench_spec_sample_eager 150 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 4 --max-tokens 128 \
    --temperature 0.7 --methods none,ddtree --budgets 16 --eager --out "$RES/sample-eager"
fi
if [[ $PART == rounds ]]; then
  step pytest_graph_all 330 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
  step pytest_bitwise_demo 230 $PYT tests/gpu/test_bitwise_gpu.py -k "greedy_spec_equals_plain_demo"
fi
if [[ $PART == decode ]]; then
  step bench_mla_decode 110 python3 bench/mla_attention.py --sweep-only --sweep-decode --no-peers --budget-s 90 \
    --out "$RES/decode"
  step pytest_mla_default 200 $PYT tests/gpu/test_mla_attention_gpu.py \
    -k "default or causal_batch_invariant or (tree_batch_invariant_bf16 and not candidate) or bf16_vs_reference"
  step pytest_bitwise_demo 110 $PYT tests/gpu/test_bitwise_gpu.py -k "greedy_spec_equals_plain_demo"
  step bench_mla 90 python3 bench/mla_attention.py --out "$RES"
fi
if [[ $PART == step ]]; then
  step bench_k2_step 230 python3 bench/k2_step.py --profile --out "$RES"
  step bench_round 120 python3 bench/round.py --prompts 2 --max-tokens 64 --budgets 32 --warmup-tokens 16 \
    --batch-invariant off --out "$RES"
fi
if [[ $PART == verify ]]; then
  step pytest_bitwise 230 $PYT tests/gpu/test_bitwise_gpu.py
  step pytest_invariance 150 $PYT tests/gpu/test_batch_invariance_gpu.py tests/gpu/test_fused_tails_gpu.py
  step pytest_target 90 $PYT tests/gpu/test_target_gpu.py
fi
if [[ $PART == resume ]]; then
  step pytest_sampled 200 $PYT tests/gpu/test_graph_round_gpu.py -k "sampled or default_mode"
  step bench_spec_sample 120 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --temperature 0.7 --budgets 8,16,32 --out "$RES/sample" --plot "$RES/sample/spec-h200.png"
  step pytest_bitwise_demo_logits 260 $PYT tests/gpu/test_bitwise_gpu.py -k demo_logits_alone
fi
if [[ $PART == tma ]]; then
  step pytest_tma 240 $PYT tests/gpu/test_w4_frag_gpu.py -k "v4_and_tma or tiled_words"
  step bench_w4_frag 300 python3 bench/w4_frag.py --no-moe --ms 1,4,16 --only "v4,tma" --out "$RES"
fi
if [[ $PART == tma2 ]]; then
  step pytest_tma 240 $PYT tests/gpu/test_w4_frag_gpu.py -k "tma_same_bits or tiled_words"
  step bench_w4_frag 300 python3 bench/w4_frag.py --no-moe --ms 1,4,16 --only "tma" --out "$RES"
fi
if [[ $PART == gsweep ]]; then
  step bench_gemm_sweep 300 python3 bench/gemm.py --sweep --shapes q_a+kv_a,shared_w2,q_b,shared_w13 --ms 4 \
    --sweep-ms 1,4,16,64,256 --no-rmsnorm --no-heads --out "$RES"
  step pytest_wgref2 130 $PYT tests/gpu/test_mla_attention_gpu.py -k "warpgroup_default_vs_reference or bf16_vs_reference"
  step pytest_wggraph 120 $PYT tests/gpu/test_graph_round_gpu.py -k "graph_replay_bitwise or device_length"
fi
if [[ $PART == wgtest ]]; then
  step pytest_wgref2 130 $PYT tests/gpu/test_mla_attention_gpu.py -k "warpgroup_default_vs_reference or bf16_vs_reference"
  step pytest_wggraph 120 $PYT tests/gpu/test_graph_round_gpu.py -k "graph_replay_bitwise or device_length"
fi
if [[ $PART == wgslice ]]; then
  step pytest_mla_biteq 240 $PYT tests/gpu/test_mla_attention_gpu.py -k "$MLA_BITEQ or warpgroup"
  step pytest_wggraph 120 $PYT tests/gpu/test_graph_round_gpu.py -k "graph_replay_bitwise or device_length"
  step bench_mla_rows 130 python3 bench/mla_attention.py --sweep-only --sweep-rows --sweep-n 8 --no-peers \
    --budget-s 70 --out "$RES"
fi
if [[ $PART == wgslice2 ]]; then
  step pytest_mla_biteq 240 $PYT tests/gpu/test_mla_attention_gpu.py -k "$MLA_BITEQ or warpgroup"
  step bench_k2_step 150 python3 bench/k2_step.py --nodes 1,4 --out "$RES"
fi
if [[ $PART == slicefin ]]; then
  step pytest_mla_biteq 240 $PYT tests/gpu/test_mla_attention_gpu.py -k "$MLA_BITEQ or warpgroup"
  step pytest_wggraph 120 $PYT tests/gpu/test_graph_round_gpu.py -k "graph_replay_bitwise or device_length"
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
fi
if [[ $PART == wgpipe ]]; then
  step pytest_wgpipe 190 $PYT tests/gpu/test_mla_attention_gpu.py -k \
    "decode_warpgroup_bit_equal or (small_trees and (wg2pipeslices or t16wg2rows16pipe or wg2rows8 or default))"
  step bench_mla_wg 190 python3 bench/mla_attention.py --sweep-only --sweep-wg --no-peers --budget-s 150 --out "$RES"
  step bench_k2_step 120 python3 bench/k2_step.py --nodes 1,4,8 --out "$RES"
  ncu_probe ncu_mla_decode_32k 60 mla_decode_32k
fi
if [[ $PART == wgqs2 ]]; then
  step pytest_wgqs2 190 $PYT tests/gpu/test_mla_attention_gpu.py -k \
    "decode_warpgroup_bit_equal or (small_trees and (wg2qs2slices or t16wg2rows16 or wg2rows8 or default))"
  step bench_mla_wg 190 python3 bench/mla_attention.py --sweep-only --sweep-wg --no-peers --budget-s 150 --out "$RES"
fi
if [[ $PART == wgfin3 ]]; then
  step pytest_mla_biteq 280 $PYT tests/gpu/test_mla_attention_gpu.py -k \
    "$MLA_BITEQ or warpgroup_default or bf16_vs_reference"
  step pytest_wggraph 110 $PYT tests/gpu/test_graph_round_gpu.py -k "graph_replay_bitwise or device_length"
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
fi
if [[ $PART == wgbench ]]; then
  step bench_k2_step 200 python3 bench/k2_step.py --out "$RES"
  step bench_mla 140 python3 bench/mla_attention.py --no-peers --out "$RES"
fi
if [[ $PART == tailmerge ]]; then
  step bench_mla_merge 90 python3 bench/mla_merge.py --out "$RES"
  step bench_mla_small 170 python3 bench/mla_attention.py --sweep-only --sweep-small --no-peers --budget-s 130 \
    --out "$RES"
fi
if [[ $PART == ltile ]]; then
  step pytest_ltile 200 $PYT tests/gpu/test_mla_attention_gpu.py -k \
    "(warpgroup or small_trees or batch_invariant) and not candidate"
  ncu_probe ncu_mla_decode_32k 40 mla_decode_32k
  step bench_mla_wg 100 python3 bench/mla_attention.py --sweep-only --sweep-wg --sweep-n 8 --no-peers --budget-s 70 \
    --out "$RES"
  step pytest_spec_bitwise 100 $PYT $SPEC_BITWISE
  step bench_k2_step 80 python3 bench/k2_step.py --nodes 1,4,8 --out "$RES"
fi
if [[ $PART == stream ]]; then
  step pytest_frag_dense 230 $PYT tests/gpu/test_w4_frag_gpu.py -k "frag_linear or int4_linear or dependent_launches"
  step bench_w4_frag_dense 300 python3 bench/w4_frag.py --no-moe --ms 1,4,16,64,256 --reps 20 --out "$RES"
fi
if [[ $PART == stream2 ]]; then
  step pytest_frag_dense 230 $PYT tests/gpu/test_w4_frag_gpu.py -k "frag_linear or int4_linear or dependent_launches"
  step bench_w4_frag_dense 200 python3 bench/w4_frag.py --no-moe --ms 1,4,16,64,256 --reps 20 \
    --only "'split': 2,'per_sm': 8,'pt': 128" --out "$RES"
fi
if [[ $PART == stream3 ]]; then
  step bench_kernels 150 python3 bench/kernels.py --no-sweep --out "$RES"
fi
if [[ $PART == streamfin ]]; then
  step pytest_frag_dense 230 $PYT tests/gpu/test_w4_frag_gpu.py -k "frag_linear or int4_linear or dependent_launches"
fi
if [[ $PART == ncutree || $PART == wgqs2 ]]; then
  for case in mla_tree4_4k mla_tree4_4k_n64 mla_tree2_4k_n64 mla_decode_4k_n64; do
    ncu_probe "ncu_$case" 45 "$case" --print-details all
  done
fi
if [[ $PART == ncuw4 ]]; then
  for case in dense_frag_m4 dense_frag_m16; do
    ncu_probe "ncu_$case" 90 "$case"
  done
fi
if [[ $PART == moestream ]]; then
  step pytest_moe_frag 170 $PYT tests/gpu/test_w4_frag_gpu.py -k "moe"
  step bench_w4_frag 240 python3 bench/w4_frag.py --no-dense --ts 1,4,16,64,256 --reps 20 --out "$RES"
  for case in moe_frag_t1 moe_frag_t4; do
    ncu_probe "ncu_$case" 75 "$case"
  done
fi
if [[ $PART == moestream2 ]]; then
  step pytest_moe_frag 150 $PYT tests/gpu/test_w4_frag_gpu.py -k "moe"
  step bench_w4_frag 120 python3 bench/w4_frag.py --no-dense --ts 1,4,16,64,256 --reps 20 --out "$RES"
  step bench_kernels 130 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_k2_step 150 python3 bench/k2_step.py --out "$RES"
fi
if [[ $PART == chunks ]]; then
  step pytest_frag 200 $PYT tests/gpu/test_w4_frag_gpu.py
  step bench_w4_frag 110 python3 bench/w4_frag.py --ms 1,4,16 --ts 1,4,16 --reps 20 --only "'tile': 0" --out "$RES"
  step bench_kernels 130 python3 bench/kernels.py --no-sweep --out "$RES"
  ncu_probe ncu_dense_frag_m4 60 dense_frag_m4
fi
if [[ $PART == chunks2 ]]; then
  step pytest_frag_tiled 200 $PYT tests/gpu/test_w4_frag_gpu.py -k "tiled_words or demo_runs"
  target_and_spec
fi
if [[ $PART == pairs ]]; then
  step pytest_frag_dense 200 $PYT tests/gpu/test_w4_frag_gpu.py -k "frag_linear or int4_linear or dependent_launches"
  step bench_w4_frag 130 python3 bench/w4_frag.py --no-moe --ms 1,4,8,16 --reps 30 --only "'pairs'" --out "$RES"
fi
if [[ $PART == pairs2 ]]; then
  step pytest_frag_dense 200 $PYT tests/gpu/test_w4_frag_gpu.py -k "frag_linear or int4_linear or dependent_launches"
  step bench_kernels 60 python3 bench/kernels.py --no-sweep --out "$RES"
fi
if [[ $PART == pairs3 ]]; then
  step pytest_frag_dense 170 $PYT tests/gpu/test_w4_frag_gpu.py -k "frag_linear or int4_linear or dependent_launches"
  step pytest_moe_frag 110 $PYT tests/gpu/test_w4_frag_gpu.py -k "moe"
  step bench_kernels 60 python3 bench/kernels.py --no-sweep --out "$RES"
  step pytest_target 60 $PYT tests/gpu/test_target_gpu.py
fi
if [[ $PART == fuse ]]; then
  step pytest_moe_frag 200 $PYT tests/gpu/test_w4_frag_gpu.py -k "moe or dependent_launches"
  step bench_kernels 60 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_k2_step 110 python3 bench/k2_step.py --out "$RES"
  step bench_bounds 90 python3 bench/launch_bounds.py --out "$RES"
  target_and_spec
fi
if [[ $PART == fuse8 ]]; then
  step pytest_moe_fused 200 $PYT tests/gpu/test_w4_frag_gpu.py -k "fused_epilogues or moe_frag_batch_invariant or dependent_launches or demo"
  step bench_kernels 60 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_k2_step 110 python3 bench/k2_step.py --out "$RES"
  step bench_bounds 60 python3 bench/launch_bounds.py --out "$RES"
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
fi
if [[ $PART == rside ]]; then
  step pytest_placement 150 $PYT tests/test_moe_placement.py
  mkdir -p "$RES/before" "$RES/rside"
  step bench_k2_before 110 env KDTREE_MOE_SHARED=before python3 bench/k2_step.py --out "$RES/before"
  step bench_k2_rside 110 env KDTREE_MOE_SHARED=router-side python3 bench/k2_step.py --out "$RES/rside"
fi
if [[ $PART == rside2 ]]; then
  step pytest_placement 150 $PYT tests/test_moe_placement.py
  step bench_k2_step 110 python3 bench/k2_step.py --out "$RES"
  target_and_spec
fi
if [[ $PART == final6 ]]; then
  step pytest_graph 280 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
fi
if [[ $PART == review2 ]]; then
  step pytest_moe_fused 150 $PYT tests/gpu/test_w4_frag_gpu.py -k "fused_epilogues or dependent_launches"
fi
if [[ $PART == ahead ]]; then
  step pytest_ahead 200 $PYT tests/gpu/test_mla_attention_gpu.py -k "ahead"
  step bench_mla_wg 200 python3 bench/mla_attention.py --sweep-only --sweep-wg --no-peers --budget-s 170 --out "$RES"
fi
if [[ $PART == stalls ]]; then
  for case in mla_decode_32k mla_tree4_4k_n64; do
    ncu_probe "ncu_stalls_$case" 60 "$case" --metrics "regex:smsp__pcsamp_warps_issue_stalled_.*"
  done
  step pytest_mla_biteq 250 $PYT tests/gpu/test_mla_attention_gpu.py -k "warpgroup or small_trees"
  step bench_mla 140 python3 bench/mla_attention.py --no-peers --out "$RES"
fi
if [[ $PART == heads ]]; then
  step bench_gemm_heads 150 python3 bench/gemm.py --shapes none --ms 1,4,16 --no-rmsnorm --no-heads --sweep-heads \
    --out "$RES"
  step bench_w4_tok8 150 python3 bench/w4_frag.py --no-moe --ms 8,16 --reps 20 --only "'tok': 8" --out "$RES"
fi
if [[ $PART == tline ]]; then
  step pytest_heads 150 $PYT tests/gpu/test_batch_invariance_gpu.py -k "head"
  step bench_k2_step 200 python3 bench/k2_step.py --nodes 1,4,8 --timeline --out "$RES"
fi
if [[ $PART == tail ]]; then
  step pytest_tail 200 $PYT tests/gpu/test_mla_attention_gpu.py -k "small_trees and tail"
  step bench_mla_small 220 python3 bench/mla_attention.py --sweep-only --sweep-small --no-peers --budget-s 190 \
    --out "$RES"
fi
if [[ $PART == final7 ]]; then
  step pytest_mla_biteq 240 $PYT tests/gpu/test_mla_attention_gpu.py -k "$MLA_BITEQ or warpgroup or reference"
  step pytest_graph 200 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
  step pytest_spec_bitwise 120 $PYT $SPEC_BITWISE
  step bench_k2_step 150 python3 bench/k2_step.py --timeline --out "$RES"
  step bench_mla 100 python3 bench/mla_attention.py --no-peers --out "$RES"
fi
if [[ $PART == final7b ]]; then
  step pytest_mla_rest 200 $PYT tests/gpu/test_mla_attention_gpu.py -k \
    "small_trees and 64 and (wg2qs2slices or t16wg2rows16 or wg2rows8)"
  step pytest_spec 200 $PYT tests/speculative/test_spec_gpu.py
fi
if [[ $PART == stail ]]; then
  step pytest_stail 150 $PYT tests/gpu/test_mla_attention_gpu.py -k "(small_trees and 64) or warpgroup_default"
  step bench_k2_step 110 python3 bench/k2_step.py --nodes 1,4,8 --timeline --out "$RES"
fi
if [[ $PART == route ]]; then
  step pytest_route 240 $PYT tests/gpu/test_router_gemm_gpu.py tests/test_moe_placement.py \
    tests/gpu/test_w4_frag_gpu.py -k "router or placement or add_is_the_explicit_add"
  step bench_router 120 python3 bench/router.py --out "$RES"
  step bench_k2_step 150 python3 bench/k2_step.py --timeline --out "$RES"
  mkdir -p "$RES/tc"
  step bench_k2_step_tc 120 env KDTREE_ROUTER_GEMM=tc python3 bench/k2_step.py --nodes 1,4,8,16,32,64 --timeline \
    --out "$RES/tc"
fi
if [[ $PART == order ]]; then
  step pytest_order 170 $PYT tests/gpu/test_mla_attention_gpu.py tests/gpu/test_graph_round_gpu.py \
    -k "small_trees or v_split_by_t or device_length"
  step bench_merge 80 python3 bench/mla_merge.py --out "$RES"
  step bench_k2_step 140 python3 bench/k2_step.py --timeline --out "$RES"
  mkdir -p "$RES/pf"
  step bench_k2_step_pf 140 python3 -c "import runpy, sys; import kdtree_engine.kernels.mla_attention as m; \
m.TAIL_FIRST = False; sys.argv = ['bench/k2_step.py', '--nodes', '4,8,16,32,64', '--timeline', '--out', '$RES/pf']; \
runpy.run_path('bench/k2_step.py', run_name='__main__')"
fi
if [[ $PART == final8 ]]; then
  step pytest_route 120 $PYT tests/gpu/test_router_gemm_gpu.py tests/test_moe_placement.py \
    tests/gpu/test_w4_frag_gpu.py -k "router or placement or add_is_the_explicit_add"
  target_and_spec
  step bench_k2_step 120 python3 bench/k2_step.py --timeline --out "$RES"
fi
if [[ $PART == rounds8 ]]; then
  step pytest_graph 250 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
  mkdir -p "$RES/r1" "$RES/r4"
  step bench_k2_r1 110 python3 bench/k2_step.py --nodes 1,4,8,16,64 --graph-rounds 1 --out "$RES/r1"
  step bench_k2_r4 130 python3 bench/k2_step.py --nodes 1,4,8,16,64 --graph-rounds 4 --out "$RES/r4"
fi
if [[ $PART == rstep ]]; then
  step pytest_rstep 120 $PYT tests/gpu/test_router_gemm_gpu.py
  step bench_router 70 python3 bench/router.py --out "$RES"
  mkdir -p "$RES/s4" "$RES/s1"
  step bench_k2_s4 100 python3 -c "import runpy, sys; from kdtree_engine.kernels import router_gemm as r; \
r.ROUTER_CONFIGS[(384, 7168)] = r.RouterGemmConfig(4, 512, 1, 16, 4); \
sys.argv = ['bench/k2_step.py', '--nodes', '1,4,16,64', '--out', '$RES/s4']; runpy.run_path('bench/k2_step.py', run_name='__main__')"
  step bench_k2_s1 100 python3 bench/k2_step.py --nodes 1,4,16,64 --out "$RES/s1"
fi
if [[ $PART == window ]]; then
  k2_variant() {  # k2_variant NAME PYTHON-PRELUDE: the K2 layer's timeline at 1 / 4 / 8 nodes after the prelude
    mkdir -p "$RES/$1"
    step "bench_k2_$1" 90 python3 -c "import runpy, sys; $2; sys.argv = ['bench/k2_step.py', '--nodes', '1,4,8', \
'--timeline', '--out', '$RES/$1']; runpy.run_path('bench/k2_step.py', run_name='__main__')"
  }
  k2_variant base "pass"
  k2_variant r8 "from kdtree_engine.kernels import router_gemm as r; \
r.ROUTER_CONFIGS[(384, 7168)] = r.RouterGemmConfig(8, 512, 4, 16)"
  k2_variant s2 "from kdtree_engine.kernels import gemm as g; \
g.K2_CONFIGS[(4096, 7168)] = (g.Reduction(128, 2), g.K2_CONFIGS[(4096, 7168)][1])"
fi
if [[ $PART == ctx ]]; then
  mkdir -p "$RES/c4000" "$RES/c4096"
  step bench_k2_c4000 100 python3 bench/k2_step.py --nodes 1,4,8,16,64 --context 4000 --timeline --out "$RES/c4000"
  step bench_k2_c4096 100 python3 bench/k2_step.py --nodes 1,4,8,16,64 --context 4096 --timeline --out "$RES/c4096"
fi
if [[ $PART == tailvs ]]; then
  step pytest_tailvs 110 $PYT tests/gpu/test_mla_attention_gpu.py -k "small_trees and 64 and (tail2 or tail4 or default)"
  for vt in 0 2 4; do
    mkdir -p "$RES/vt$vt"
    step "bench_k2_vt$vt" 80 python3 -c "import runpy, sys; from dataclasses import replace; \
from kdtree_engine.kernels import mla_attention as m; n, c = m.DEFAULT_CONFIGS[1]; \
m.DEFAULT_CONFIGS[1] = (n, replace(c, TAIL_V_SPLIT=$vt)); sys.argv = ['bench/k2_step.py', '--nodes', '4,8', \
'--context', '4000', '--timeline', '--out', '$RES/vt$vt']; runpy.run_path('bench/k2_step.py', run_name='__main__')"
  done
  step pytest_moe_pairs 150 $PYT tests/gpu/test_w4_frag_gpu.py -k "moe_frag_matches_reference_small or moe_frag_batch_invariant"
fi
if [[ $PART == vwg ]]; then
  step pytest_vwg 150 $PYT tests/gpu/test_mla_attention_gpu.py -k "verify_warpgroup"
  step bench_mla_verify 150 python3 bench/mla_attention.py --sweep-only --sweep-verify --no-peers --budget-s 110 \
    --out "$RES"
  for vw in 2 0; do
    mkdir -p "$RES/vw$vw"
    step "bench_k2_vw$vw" 110 python3 -c "import runpy, sys; from dataclasses import replace; \
from kdtree_engine.kernels import mla_attention as m; n, c = m.DEFAULT_CONFIGS[1]; \
m.DEFAULT_CONFIGS[1] = (n, replace(c, VERIFY_WG=$vw)); sys.argv = ['bench/k2_step.py', '--nodes', '16,32,64', \
'--timeline', '--out', '$RES/vw$vw']; runpy.run_path('bench/k2_step.py', run_name='__main__')"
  done
  step pytest_moe_pairs 150 $PYT tests/gpu/test_w4_frag_gpu.py -k "moe_frag_matches_reference_small or moe_frag_batch_invariant"
fi
if [[ $PART == vwg2 ]]; then
  step pytest_mla_vwg 330 $PYT tests/gpu/test_mla_attention_gpu.py -k \
    "verify_warpgroup or tree_batch_invariant or vs_reference or v_split_by_t or small_trees"
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
fi
if [[ $PART == vwg3 ]]; then
  step bench_k2_step 130 python3 bench/k2_step.py --timeline --out "$RES"
  step bench_mla 140 python3 bench/mla_attention.py --no-peers --out "$RES"
  step pytest_graph 220 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
  step pytest_mla_qs2 60 $PYT tests/gpu/test_mla_attention_gpu.py -k "qs2"
fi
if [[ $PART == vwg4 ]]; then
  for i in 1 2 3; do
    mkdir -p "$RES/k$i"
    step "bench_k2_$i" 110 python3 bench/k2_step.py $([[ $i == 3 ]] && echo --timeline) --out "$RES/k$i"
  done
fi
if [[ $PART == vwg5 ]]; then
  step pytest_wg 240 $PYT tests/gpu/test_mla_attention_gpu.py -k "verify_warpgroup or decode_warpgroup or tree_batch_invariant"
fi
if [[ $PART == vwg6 ]]; then
  step pytest_vwg 120 $PYT tests/gpu/test_mla_attention_gpu.py -k "verify_warpgroup"
  step bench_mla_verify 100 python3 bench/mla_attention.py --sweep-only --sweep-verify --no-peers --budget-s 60 \
    --out "$RES"
  step bench_k2_step 80 python3 bench/k2_step.py --nodes 16,32,64 --out "$RES"
fi
if [[ $PART == moegrid ]]; then
  step pytest_order 200 $PYT tests/gpu/test_w4_frag_gpu.py -k "grid_order"
  step bench_moe_grid 330 python3 bench/w4_frag.py --no-dense --ts 16,64,256 --reps 20 --only "compact,order" \
    --out "$RES"
  ncu_probe ncu_moe_frag_t64 150 moe_frag_t64 --kernel-name regex:_moe_frag_kernel --launch-count 2
fi
if [[ $PART == stile ]]; then
  step pytest_stile 240 $PYT tests/gpu/test_w4_frag_gpu.py -k "tiled_scales"
  step bench_stile 330 python3 bench/w4_frag.py --ms 1,4,16 --ts 1,4,16,64,256 --reps 20 --only "stile" \
    --out "$RES"
fi
if [[ $PART == stile2 ]]; then
  step pytest_frag 300 $PYT tests/gpu/test_w4_frag_gpu.py
  step pytest_target 90 $PYT tests/gpu/test_target_gpu.py
  step bench_kernels 70 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_k2_step 110 python3 bench/k2_step.py --out "$RES"
fi
if [[ $PART == stile3 ]]; then
  step pytest_frag_rest 200 $PYT tests/gpu/test_w4_frag_gpu.py -k "(fused_epilogues and small) or \
moe_frag_batch_invariant or plan_token_tiles or demo_runs or dependent_launches or tiled_scales"
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
  step pytest_graph_demo 120 $PYT tests/gpu/test_graph_round_gpu.py -k "demo_bf16 or default_mode"
  step bench_k2_step 110 python3 bench/k2_step.py --out "$RES"
fi
if [[ $PART == stile4 ]]; then
  step bench_stile 300 python3 bench/w4_frag.py --ms 1,4,16 --ts 1,4,16,64 --reps 20 --only stile --out "$RES"
  step bench_k2_step 110 python3 bench/k2_step.py --timeline --out "$RES"
fi
if [[ $PART == rwarps ]]; then
  step pytest_router 150 $PYT tests/gpu/test_router_gemm_gpu.py
  step bench_router 90 python3 bench/router.py --out "$RES"
  step bench_k2_step 110 python3 bench/k2_step.py --out "$RES"
fi
if [[ $PART == review ]]; then
  step pytest_moe_frag 240 $PYT tests/gpu/test_w4_frag_gpu.py -k "moe or tiled_scales"
  step bench_kernels 70 python3 bench/kernels.py --no-sweep --out "$RES"
fi
if [[ $PART == pf ]]; then
  step bench_pf 380 python3 bench/w4_frag.py --ms 1,4,16 --ts 1,4,16,64 --reps 20 --only pf --out "$RES"
  step pytest_pf 190 $PYT tests/gpu/test_w4_frag_gpu.py -k "prefetch"
fi
if [[ $PART == early ]]; then
  step bench_mla_merge 150 python3 bench/mla_merge.py --out "$RES"
  k2_early() {  # k2_early NAME PYTHON-PRELUDE: the K2 layer's timeline at 4 / 16 / 64 nodes after the prelude
    mkdir -p "$RES/$1"
    step "bench_k2_$1" 130 python3 -c "import runpy, sys; $2; sys.argv = ['bench/k2_step.py', '--nodes', '4,16,64', \
'--timeline', '--out', '$RES/$1']; runpy.run_path('bench/k2_step.py', run_name='__main__')"
  }
  k2_early base "pass"
  k2_early early "from kdtree_engine.kernels import mla_attention as a; f = a.merge_tiles; \
a.merge_tiles = lambda *v: f(*v)._replace(early=True)"
fi
if [[ $PART == srcstall ]]; then
  for case in mla_decode_32k mla_tree64_4k_n64 dense_frag_m16; do
    ncu_probe "ncu_src_$case" 100 "$case" --section SourceCounters --print-details all
  done
fi
if [[ $PART == early2 ]]; then
  step pytest_early 150 $PYT tests/gpu/test_mla_attention_gpu.py -k "merge_early or decode_warpgroup_bit or verify_warpgroup"
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
  step bench_mla 140 python3 bench/mla_attention.py --no-peers --out "$RES"
  step bench_k2_step 120 python3 bench/k2_step.py --out "$RES"
fi
if [[ $PART == again ]]; then
  step bench_kernels 150 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_mla 140 python3 bench/mla_attention.py --no-peers --out "$RES"
  for i in 1 2 3; do
    mkdir -p "$RES/k2_$i"
    step "bench_k2_step_$i" 90 python3 bench/k2_step.py --out "$RES/k2_$i"
  done
fi
if [[ $PART == l2 ]]; then
  L2_METRICS="dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors.sum,lts__t_sectors_op_read.sum,\
lts__t_sectors_op_write.sum,lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_tex_op_read.sum,\
lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,\
lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum"
  for case in moe_frag_t16 moe_frag_t64; do
    ncu_probe "ncu_l2_$case" 170 "$case" --metrics "$L2_METRICS" --section MemoryWorkloadAnalysis_Tables
  done
fi
if [[ $PART == clocks ]]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu --format=csv \
    -lms 50 > "$RES/clocks.csv" 2>&1 &
  CLK1=$!
  nvidia-smi --query-gpu=timestamp,clocks_throttle_reasons.active --format=csv -lms 50 > "$RES/throttle.csv" 2>&1 &
  CLK2=$!
  step bench_kernels 150 python3 bench/kernels.py --no-sweep --out "$RES"
  mkdir -p "$RES/k2"
  step bench_k2_step 120 python3 bench/k2_step.py --nodes 16,64 --out "$RES/k2"
  kill $CLK1 $CLK2 2>/dev/null
  wait $CLK1 $CLK2 2>/dev/null
fi
if [[ $PART == bf16x3 ]]; then
  step bench_router 100 python3 bench/router.py --out "$RES"
  for i in 1 2; do
    mkdir -p "$RES/k2_fma_$i" "$RES/k2_bf16x3_$i"
    step "bench_k2_fma_$i" 70 env KDTREE_ROUTER_GEMM=router python3 bench/k2_step.py --nodes 1,16,64 --out "$RES/k2_fma_$i"
    step "bench_k2_bf16x3_$i" 70 python3 bench/k2_step.py --nodes 1,16,64 --out "$RES/k2_bf16x3_$i"
  done
  step pytest_router 100 $PYT tests/gpu/test_router_gemm_gpu.py -k "bf16x3 or partials"
  target_and_spec
fi
if [[ $PART == rside3 ]]; then
  for i in 1 2; do
    mkdir -p "$RES/k2_base_$i" "$RES/k2_rside_$i"
    step "bench_k2_base_$i" 70 python3 bench/k2_step.py --nodes 4,16,32,64 --out "$RES/k2_base_$i"
    step "bench_k2_rside_$i" 70 env KDTREE_MOE_SHARED=router-side python3 bench/k2_step.py --nodes 4,16,32,64 \
      --out "$RES/k2_rside_$i"
  done
fi
if [[ $PART == final9 ]]; then
  step pytest_bitwise 240 $PYT tests/gpu/test_bitwise_gpu.py tests/test_moe_placement.py -k "not demo_logits_alone"
  step pytest_graph 300 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
fi
if [[ $PART == final9b ]]; then
  step bench_k2_step 150 python3 bench/k2_step.py --timeline --out "$RES"
fi
if [[ $PART == before3 ]]; then
  for i in 1 2; do
    mkdir -p "$RES/k2_base_$i" "$RES/k2_before_$i"
    step "bench_k2_base_$i" 50 python3 bench/k2_step.py --nodes 1,4,8 --out "$RES/k2_base_$i"
    step "bench_k2_before_$i" 50 env KDTREE_MOE_SHARED=before python3 bench/k2_step.py --nodes 1,4,8 \
      --out "$RES/k2_before_$i"
  done
fi
if [[ $PART == wgasync ]]; then
  # caps sum to 570 s: one device call (the tests compiled 79 dense cases in 179 s before the async ones)
  step pytest_wgasync 360 $PYT tests/gpu/test_w4_frag_gpu.py -k "stream_partition or wgmma"
  step bench_wgasync 170 python3 bench/w4_frag.py --no-moe --ms 1,4,16,32,64,256 --only async --out "$RES"
  step frag_aot 40 python3 bench/frag_aot.py --out "$RES"
fi
if [[ $PART == final8b ]]; then
  step pytest_graph 250 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
fi
if [[ $PART == bounds ]]; then
  step bench_bounds 200 python3 bench/launch_bounds.py --out "$RES"
fi
if [[ $PART == prefetch ]]; then
  step pytest_prefetch 200 $PYT tests/gpu -k "prefetch or dependent_launch"
  mkdir -p "$RES/on" "$RES/off"
  step bench_k2_on 110 python3 bench/k2_step.py --nodes 1,4,8 --out "$RES/on"
  step bench_k2_off 110 python3 bench/k2_step.py --nodes 1,4,8 --no-prefetch --out "$RES/off"
  step bench_kernels_on 60 python3 bench/kernels.py --no-sweep --out "$RES/on"
  step bench_kernels_off 60 python3 bench/kernels.py --no-sweep --no-prefetch --out "$RES/off"
fi
if [[ $PART == ncumoe ]]; then
  for case in moe_frag_t1 moe_frag_t4; do
    ncu_probe "ncu_$case" 150 "$case"
  done
fi
if [[ $PART == ncu ]]; then
  for case in mla_decode_32k mla_decode_128k mla_verify16_32k moe_t1 moe_t16 dense_m1; do
    ncu_probe "ncu_$case" 75 "$case"
  done
  step pytest_sampled 200 $PYT tests/gpu/test_graph_round_gpu.py -k "sampled or default_mode"
fi
if [[ $PART == rows ]]; then
  step bench_mla_rows 150 python3 bench/mla_attention.py --sweep-only --sweep-rows --no-peers --budget-s 110 --out "$RES"
  step pytest_mla_rows 240 $PYT tests/gpu/test_mla_attention_gpu.py -k "decode_rows or ($MLA_BITEQ)"
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
fi
if [[ $PART == kload ]]; then
  step bench_mla 60 python3 bench/mla_attention.py --no-peers --out "$RES"
  step bench_mla_rows 160 python3 bench/mla_attention.py --sweep-only --sweep-rows --no-peers --budget-s 120 --out "$RES"
  step pytest_mla_kload 230 $PYT tests/gpu/test_mla_attention_gpu.py -k "decode_rows or ($MLA_BITEQ)"
  step pytest_spec_bitwise 120 $PYT $SPEC_BITWISE
fi
if [[ $PART == lazy ]]; then
  step bench_mla_rows 170 python3 bench/mla_attention.py --sweep-only --sweep-rows --no-peers --budget-s 130 --out "$RES"
  step pytest_mla_lazy 150 $PYT tests/gpu/test_mla_attention_gpu.py -k "decode_rows and (lazy or rows1 or kdesc)"
  step bench_k2_step 230 python3 bench/k2_step.py --profile --out "$RES"
fi
if [[ $PART == rounds2 ]]; then
  step bench_round 150 python3 bench/round.py --out "$RES"
  step pytest_demo_logits 380 $PYT tests/gpu/test_bitwise_gpu.py::test_demo_logits_alone_equal_rows_in_verify_blocks
fi
if [[ $PART == maxnreg ]]; then
  step bench_kernels_sweep 200 python3 bench/kernels.py --sweep-only --sweep-moe-only --sweep-budget 170 --out "$RES"
  step pytest_moe_caps 150 $PYT tests/gpu/test_kernels_gpu.py -k "register_caps or moe_batch_invariant"
fi
if [[ $PART == qsplit ]]; then
  step bench_mla 50 python3 bench/mla_attention.py --no-peers --out "$RES"
  step bench_mla_rows 80 python3 bench/mla_attention.py --sweep-only --sweep-rows --no-peers --budget-s 50 --out "$RES"
  step pytest_mla_qs 130 $PYT tests/gpu/test_mla_attention_gpu.py \
    -k "(decode_rows and (rows1 or warps8)) or ((batch_invariant or bit_equal or vs_reference) and not kom and not qil and not candidate)"
  step pytest_spec_bitwise 100 $PYT $SPEC_BITWISE
  step pytest_target 60 $PYT tests/gpu/test_target_gpu.py
fi
if [[ $PART == stages ]]; then
  step bench_mla_rows 150 python3 bench/mla_attention.py --sweep-only --sweep-rows --no-peers --budget-s 110 --out "$RES"
  step pytest_mla_stages 230 $PYT tests/gpu/test_mla_attention_gpu.py -k "decode_rows or ($MLA_BITEQ)"
  step pytest_spec_bitwise 110 $PYT $SPEC_BITWISE
  step pytest_target 60 $PYT tests/gpu/test_target_gpu.py
fi
if [[ $PART == down ]]; then
  step bench_kernels_sweep 200 python3 bench/kernels.py --sweep-only --sweep-moe-only --sweep-budget 170 --out "$RES"
  step pytest_moe 200 $PYT tests/gpu/test_kernels_gpu.py -k "moe"
fi
if [[ $PART == m64 ]]; then
  step bench_kernels_sweep 230 python3 bench/kernels.py --sweep-only --sweep-budget 200 --out "$RES"
  step pytest_w4 200 $PYT tests/gpu/test_kernels_gpu.py -k "config_variants or batch_invariant"
fi
if [[ $PART == merge4 ]]; then
  step bench_mla_merge 150 python3 bench/mla_merge.py --out "$RES"
fi
if [[ $PART == merge5 ]]; then
  step bench_mla_merge 90 python3 bench/mla_merge.py --out "$RES"
  step bench_mla 70 python3 bench/mla_attention.py --no-peers --out "$RES"
  step pytest_mla 230 $PYT tests/gpu/test_mla_attention_gpu.py -k "decode_rows or ($MLA_BITEQ)"
  step pytest_spec_bitwise 130 $PYT $SPEC_BITWISE tests/gpu/test_graph_round_gpu.py::test_graph_rounds_with_triton_attention
fi
if [[ $PART == moerows ]]; then
  step bench_kernels_sweep 220 python3 bench/kernels.py --sweep-only --sweep-moe-rows --sweep-budget 180 --out "$RES"
  step pytest_moe 130 $PYT tests/gpu/test_kernels_gpu.py -k "moe"
  step bench_k2_step 200 python3 bench/k2_step.py --profile --out "$RES"
fi
if [[ $PART == moe16 ]]; then
  step pytest_moe_rows 90 $PYT tests/gpu/test_kernels_gpu.py -k "block_rows or batch_invariant or align or k2_layer"
  step bench_kernels 80 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_k2_step 150 python3 bench/k2_step.py --profile --out "$RES"
  step pytest_bitwise 160 $PYT tests/gpu/test_bitwise_gpu.py -k "not demo_logits"
fi
if [[ $PART == moe16b ]]; then
  step pytest_bitwise_demo 200 $PYT tests/gpu/test_bitwise_gpu.py -k "spec_equals_plain_demo"
  step bench_round 140 python3 bench/round.py --out "$RES"
  step pytest_graph 200 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
fi
if [[ $PART == router ]]; then
  step bench_router 90 python3 bench/router.py --out "$RES"
  step bench_k2_profile 150 python3 bench/k2_step.py --nodes 1,16 --profile --out "$RES/profile"
fi
if [[ $PART == router2 ]]; then
  step bench_router 60 python3 bench/router.py --out "$RES"
  step pytest_fp32 200 $PYT tests/gpu/test_batch_invariance_gpu.py -k "other_dtypes or router" \
    tests/gpu/test_graph_round_gpu.py -k "fp32 or other_dtypes or router"
  step bench_k2_step 150 python3 bench/k2_step.py --profile --out "$RES"
fi
if [[ $PART == router3 ]]; then
  step bench_router 60 python3 bench/router.py --profile --out "$RES"
fi
if [[ $PART == final3 ]]; then
  step pytest_kernels 220 $PYT tests/gpu/test_kernels_gpu.py tests/gpu/test_batch_invariance_gpu.py
  step pytest_bitwise 200 $PYT tests/gpu/test_bitwise_gpu.py -k "not demo_logits"
fi
if [[ $PART == final2 ]]; then
  step pytest_kernels 160 $PYT tests/gpu/test_kernels_gpu.py tests/gpu/test_batch_invariance_gpu.py
  step pytest_bitwise 150 $PYT tests/gpu/test_bitwise_gpu.py -k "not demo_logits"
fi
if [[ $PART == bm8 ]]; then
  step bench_kernels_sweep 200 python3 bench/kernels.py --sweep-only --sweep-moe-only --sweep-budget 170 --out "$RES"
  step pytest_moe 200 $PYT tests/gpu/test_kernels_gpu.py -k "moe"
fi
if [[ $PART == plane2 ]]; then
  step bench_plane 300 python3 bench/w4_plane_probe.py --out "$RES"
  ncu_probe ncu_plane_wb_m1 90 plane_wb_m1
fi
if [[ $PART == plane ]]; then
  step bench_plane 300 python3 bench/w4_plane_probe.py --out "$RES"
  ncu_probe ncu_plane_m1 90 plane_m1 --print-details all
  ncu_probe ncu_plane_m1_plain 90 plane_m1
fi
if [[ $PART == merge ]]; then
  step pytest_mla 240 $PYT tests/gpu/test_mla_attention_gpu.py
  step bench_mla 150 python3 bench/mla_attention.py --out "$RES"
  step bench_mla_chunk 120 python3 bench/mla_attention.py --sweep-only --sweep-chunk --no-peers --budget-s 100 \
    --out "$RES"
  ncu_probe ncu_mla_decode_128k 60 mla_decode_128k
fi
if [[ $PART == merge2 || $PART == merge3 ]]; then
  step pytest_mla 300 $PYT tests/gpu/test_mla_attention_gpu.py -k "not candidate and not kom and not qil"
  step bench_mla 120 python3 bench/mla_attention.py --out "$RES"
  step pytest_spec_bitwise 240 $PYT $SPEC_BITWISE tests/gpu/test_graph_round_gpu.py::test_graph_rounds_with_triton_attention
fi
if [[ $PART == merge3 ]]; then
  step bench_k2_step 230 python3 bench/k2_step.py --profile --out "$RES"
fi
if [[ $PART == sample2 ]]; then
  step bench_spec_sample 150 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --temperature 0.7 --budgets 8,16,32 --out "$RES/sample" --plot "$RES/sample/spec-h200.png"
fi
if [[ $PART == fork ]]; then
  step bench_mla 40 python3 bench/mla_attention.py --no-peers --out "$RES"
  step pytest_spec_bitwise 110 $PYT $SPEC_BITWISE tests/gpu/test_graph_round_gpu.py::test_graph_rounds_with_triton_attention
  step pytest_mla 120 $PYT tests/gpu/test_mla_attention_gpu.py -k "$MLA_BITEQ"
fi
if [[ $PART == last ]]; then
  step bench_round 110 python3 bench/round.py --out "$RES"
  step pytest_graph_rest 170 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py \
    --deselect tests/gpu/test_graph_round_gpu.py::test_device_round_has_no_host_sync \
    --deselect tests/gpu/test_graph_round_gpu.py::test_graph_rounds_equal_plain_tiny_fp32 \
    --deselect tests/gpu/test_graph_round_gpu.py::test_graph_rounds_equal_plain_demo_fp32 \
    --deselect tests/gpu/test_graph_round_gpu.py::test_graph_replay_equals_device_eager_demo_bf16
  step pytest_bitwise_demo 170 $PYT tests/gpu/test_bitwise_gpu.py -k demo
fi
if [[ $PART == finish ]]; then
  step pytest_bitwise_demo 170 $PYT tests/gpu/test_bitwise_gpu.py -k demo
  step pytest_graph 150 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
  step pytest_target 60 $PYT tests/gpu/test_target_gpu.py
  step pytest_kernels 110 $PYT tests/gpu/test_kernels_gpu.py -k "k2 or batch_invariant or odd_shapes or graph or unowned"
  step bench_round 45 python3 bench/round.py --out "$RES"
fi
if [[ $PART == frag ]]; then
  step pytest_frag 200 $PYT tests/gpu/test_w4_frag_gpu.py
  step bench_w4_frag 350 python3 bench/w4_frag.py --out "$RES"
fi
if [[ $PART == frag2 ]]; then
  step pytest_frag 200 $PYT tests/gpu/test_w4_frag_gpu.py
  step pytest_spec_bitwise 200 $PYT $SPEC_BITWISE
  step pytest_target 100 $PYT tests/gpu/test_target_gpu.py
  step bench_round 110 python3 bench/round.py --out "$RES"
fi
if [[ $PART == frag3 ]]; then
  step bench_kernels 200 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_w4_frag 150 python3 bench/w4_frag.py --no-dense --out "$RES"
  step bench_k2_step 230 python3 bench/k2_step.py --profile --out "$RES"
fi
if [[ $PART == frag4 ]]; then
  step pytest_frag 120 $PYT tests/gpu/test_w4_frag_gpu.py
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
  step pytest_graph 170 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py \
    --deselect tests/gpu/test_graph_round_gpu.py::test_device_length_attention_bitwise_gpu
  step bench_kernels 60 python3 bench/kernels.py --no-sweep --out "$RES"
  step pytest_moe 90 $PYT tests/gpu/test_kernels_gpu.py -k "moe"
fi
if [[ $PART == frag5 ]]; then
  step pytest_graph_rest 220 $PYT tests/gpu/test_graph_round_gpu.py::test_sampled_graph_rounds_equal_device_eager_and_follow_the_target \
    tests/speculative/test_spec_gpu.py
  step bench_spec 200 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --out "$RES/spec" --plot "$RES/spec/spec-h200.png"
fi
if [[ $PART == frag7 ]]; then
  step pytest_frag 150 $PYT tests/gpu/test_w4_frag_gpu.py
  step bench_w4_frag 150 python3 bench/w4_frag.py --no-dense --ts 1,4,16,64 --out "$RES"
fi
if [[ $PART == frag8 ]]; then
  step pytest_frag 120 $PYT tests/gpu/test_w4_frag_gpu.py
  step pytest_spec_bitwise 120 $PYT tests/gpu/test_bitwise_gpu.py::test_greedy_spec_equals_plain_demo
fi
if [[ $PART == xsm ]]; then
  step bench_w4_frag 520 python3 bench/w4_frag.py --out "$RES"
fi
if [[ $PART == xsm2 ]]; then
  step pytest_frag 150 $PYT tests/gpu/test_w4_frag_gpu.py
  step pytest_align 60 $PYT tests/gpu/test_kernels_gpu.py -k "moe_align"
  step bench_w4_frag 120 python3 bench/w4_frag.py --out "$RES"
  step bench_kernels 120 python3 bench/kernels.py --no-sweep --out "$RES"
  ncu_probe ncu_moe_frag_t1 60 moe_frag_t1
fi
if [[ $PART == xsm3 ]]; then
  step pytest_frag 150 $PYT tests/gpu/test_w4_frag_gpu.py
  step bench_w4_frag 150 python3 bench/w4_frag.py --no-dense --out "$RES"
  step bench_kernels 120 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_k2_step 150 python3 bench/k2_step.py --profile --out "$RES"
fi
if [[ $PART == xsm4 ]]; then
  step pytest_frag 110 $PYT tests/gpu/test_w4_frag_gpu.py
  step pytest_align 40 $PYT tests/gpu/test_kernels_gpu.py -k "moe_align"
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
  step pytest_target 90 $PYT tests/gpu/test_target_gpu.py
  step bench_kernels 40 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_round 110 python3 bench/round.py --out "$RES"
fi
if [[ $PART == xsm5 ]]; then
  step bench_spec 200 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --out "$RES/spec" --plot "$RES/spec/spec-h200.png"
  step pytest_graph 200 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py \
    --deselect tests/gpu/test_graph_round_gpu.py::test_device_length_attention_bitwise_gpu
fi
if [[ $PART == xsm6 ]]; then
  step pytest_frag 120 $PYT tests/gpu/test_w4_frag_gpu.py
  step bench_w4_frag 100 python3 bench/w4_frag.py --no-dense --ts 1,4,16,64,256 --out "$RES"
fi
if [[ $PART == router4 ]]; then
  step pytest_router_gemm 40 $PYT tests/gpu/test_router_gemm_gpu.py
  step pytest_spec_bitwise 100 $PYT tests/gpu/test_bitwise_gpu.py::test_greedy_spec_equals_plain_demo
  step bench_router 40 python3 bench/router.py --out "$RES"
  step bench_k2_step 80 python3 bench/k2_step.py --profile --out "$RES"
  step pytest_target 60 $PYT tests/gpu/test_target_gpu.py
fi
if [[ $PART == arrive ]]; then
  step pytest_arrive 120 $PYT tests/gpu/test_w4_frag_gpu.py -k "last_program or topk_sum_in_down or graph_replays"
  mkdir -p "$RES/base"
  step bench_w4_frag_base 70 env PYTHONPATH="$PWD/.abbase" python3 .abbase/bench/w4_frag.py --no-dense --ts 1,4,16 \
    --out "$RES/base"
  step bench_w4_frag 160 python3 bench/w4_frag.py --ts 1,4,16,64 --ms 1,4,16 --out "$RES"
  step bench_kernels 45 python3 bench/kernels.py --no-sweep --out "$RES"
  step pytest_frag 130 $PYT tests/gpu/test_w4_frag_gpu.py -k "not (last_program or topk_sum_in_down or graph_replays)"
fi
if [[ $PART == tune2 ]]; then
  step bench_w4_frag 240 python3 bench/w4_frag.py --ts 1,4,16,64 --ms 1,4,16 --out "$RES"
fi
if [[ $PART == direct ]]; then
  step pytest_frag 150 $PYT tests/gpu/test_w4_frag_gpu.py
  step bench_w4_frag 90 python3 bench/w4_frag.py --no-dense --ts 1,4,16 --out "$RES"
  step bench_kernels 45 python3 bench/kernels.py --no-sweep --out "$RES"
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
  step bench_round 110 python3 bench/round.py --out "$RES"
fi
if [[ $PART == epi ]]; then
  step pytest_frag 150 $PYT tests/gpu/test_w4_frag_gpu.py
  step bench_kernels 45 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_w4_frag 90 python3 bench/w4_frag.py --no-dense --ts 1,4,16 --out "$RES"
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
fi
if [[ $PART == pdl ]]; then
  step pytest_frag 170 $PYT tests/gpu/test_w4_frag_gpu.py
  step bench_w4_frag 120 python3 bench/w4_frag.py --ts 1,4,16,64 --ms 1,4,16 --out "$RES"
  step bench_kernels 45 python3 bench/kernels.py --no-sweep --out "$RES"
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
fi
if [[ $PART == pdl2 ]]; then
  step pytest_frag 120 $PYT tests/gpu/test_w4_frag_gpu.py
  step bench_kernels 45 python3 bench/kernels.py --no-sweep --out "$RES"
  step pytest_spec_bitwise 120 $PYT $SPEC_BITWISE
  step bench_w4_frag 60 python3 bench/w4_frag.py --no-dense --ts 1,4,16 --out "$RES"
  step pytest_align 40 $PYT tests/gpu/test_kernels_gpu.py -k "moe_align"
  step bench_k2_step 80 python3 bench/k2_step.py --profile --out "$RES"
  step bench_round 95 python3 bench/round.py --out "$RES"
fi
if [[ $PART == pdl3 ]]; then
  step pytest_bi 110 $PYT tests/gpu/test_batch_invariance_gpu.py -k "bi_linear or bi_head"
  step pytest_spec_bitwise 120 $PYT $SPEC_BITWISE
  step bench_k2_step 70 python3 bench/k2_step.py --profile --out "$RES"
  step pytest_target 90 $PYT tests/gpu/test_target_gpu.py
  step pytest_frag 100 $PYT tests/gpu/test_w4_frag_gpu.py -k "dependent or batch_invariant or same_bits"
fi
if [[ $PART == rgemv ]]; then
  step pytest_router 60 $PYT tests/gpu/test_router_gemm_gpu.py
  step bench_router 60 python3 bench/router.py --out "$RES"
  step pytest_spec_bitwise 120 $PYT $SPEC_BITWISE
  step bench_k2_step 70 python3 bench/k2_step.py --profile --out "$RES"
  step pytest_target 90 $PYT tests/gpu/test_target_gpu.py
fi
if [[ $PART == rgemv2 ]]; then
  step pytest_router 90 $PYT tests/gpu/test_router_gemm_gpu.py
  step bench_router 90 python3 bench/router.py --out "$RES"
fi
if [[ $PART == pdl4 ]]; then
  step pytest_router 60 $PYT tests/gpu/test_router_gemm_gpu.py -k table
  step pytest_tails 60 $PYT tests/gpu/test_fused_tails_gpu.py
  step bench_router 60 python3 bench/router.py --out "$RES"
  step pytest_spec_bitwise 120 $PYT $SPEC_BITWISE
  step bench_k2_step 70 python3 bench/k2_step.py --profile --out "$RES"
  step pytest_graph 150 $PYT tests/gpu/test_graph_round_gpu.py -k "not sampled and not triton_attention and not device_length"
fi
if [[ $PART == pdl5 ]]; then
  step bench_round 95 python3 bench/round.py --out "$RES"
  step pytest_target 90 $PYT tests/gpu/test_target_gpu.py
  step pytest_mla 150 $PYT tests/gpu/test_mla_attention_gpu.py -k "not candidate"
  step pytest_bi_rms 60 $PYT tests/gpu/test_batch_invariance_gpu.py -k rmsnorm
fi
if [[ $PART == shared ]]; then
  for p in side after before; do
    mkdir -p "$RES/$p"
    step bench_k2_step_$p 60 env KDTREE_MOE_SHARED=$p python3 bench/k2_step.py --nodes 1,4,16,64 --out "$RES/$p"
  done
  mkdir -p "$RES/generic"
  step bench_k2_step_generic 60 env KDTREE_ROUTER_GEMM=generic python3 bench/k2_step.py --nodes 1,4,16,64 --out "$RES/generic"
fi
if [[ $PART == final4 ]]; then
  step pytest_spec_bitwise 120 $PYT $SPEC_BITWISE
  step bench_k2_step 70 python3 bench/k2_step.py --profile --out "$RES"
  step bench_round 95 python3 bench/round.py --out "$RES"
  step sweep_vsplit 150 python3 bench/mla_attention.py --sweep-only --sweep-vsplit --no-peers --budget-s 120 --out "$RES"
fi
if [[ $PART == spec4 ]]; then
  step bench_spec 200 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --out "$RES/spec" --plot "$RES/spec/spec-h200.png"
fi
if [[ $PART == round5 ]]; then
  step pytest_round_kernels 120 $PYT tests/gpu/test_draft_attention_gpu.py tests/gpu/test_accept_walk_gpu.py \
    tests/gpu/test_row_select_gpu.py tests/gpu/test_router_gemm_gpu.py -k "not candidate"
  step bench_spec 200 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --out "$RES/spec" --plot "$RES/spec/spec-h200.png"
  step bench_round 100 python3 bench/round.py --budgets 16 --prompts 2 --out "$RES"
  step pytest_spec_bitwise 110 $PYT $SPEC_BITWISE
fi
if [[ $PART == round6 ]]; then
  step pytest_graph 230 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
  step bench_spec32 170 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 32 --max-tokens 128 \
    --out "$RES/spec32" --plot "$RES/spec32/spec-h200-32prompts.png"
fi
if [[ $PART == round7 ]]; then
  step diag_tree 90 python3 scripts/diag_tree_gpu.py
  step pytest_graph_rest 150 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py \
    -k "tree_builder or round_bench or sampled or spec"
fi
if [[ $PART == tiled ]]; then
  step pytest_tiled 200 $PYT tests/gpu/test_w4_frag_gpu.py -k "tiled or activation_loads or plan_token or matches_reference"
  step bench_w4_frag 300 python3 bench/w4_frag.py --no-moe --ms 1,4,16 --out "$RES"
fi
if [[ $PART == tiled2 ]]; then
  step pytest_frag 200 $PYT tests/gpu/test_w4_frag_gpu.py
  step bench_w4_frag 150 python3 bench/w4_frag.py --no-moe --ms 1,4,16 --out "$RES"
  step bench_kernels 240 python3 bench/kernels.py --no-sweep --out "$RES"
  step pytest_target 150 $PYT tests/gpu/test_target_gpu.py
fi
if [[ $PART == tiled3 ]]; then
  step pytest_frag 220 $PYT tests/gpu/test_w4_frag_gpu.py
  step pytest_target 150 $PYT tests/gpu/test_target_gpu.py
  step bench_w4_frag 200 python3 bench/w4_frag.py --no-dense --ts 1,4,16,64 --out "$RES"
  step bench_kernels 240 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_k2_step 300 python3 bench/k2_step.py --profile --out "$RES"
fi
if [[ $PART == tiled4 ]]; then
  step pytest_tiled 150 $PYT tests/gpu/test_w4_frag_gpu.py -k "tiled"
  step bench_w4_frag 300 python3 bench/w4_frag.py --ms 1,4,16 --ts 1,4,16,64 --out "$RES"
fi
if [[ $PART == tiled5 ]]; then
  step pytest_frag 200 $PYT tests/gpu/test_w4_frag_gpu.py
  step pytest_target 120 $PYT tests/gpu/test_target_gpu.py
  step pytest_spec_bitwise 110 $PYT $SPEC_BITWISE
  step pytest_graph 200 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
fi
if [[ $PART == tiled6 ]]; then
  step bench_kernels 150 python3 bench/kernels.py --no-sweep --out "$RES"
  step bench_k2_step 150 python3 bench/k2_step.py --profile --out "$RES"
  step bench_spec 170 python3 -m kdtree_engine.bench_spec --device cuda --num-prompts 8 --max-tokens 128 \
    --out "$RES/spec" --plot "$RES/spec/spec-h200.png"
  step bench_round 90 python3 bench/round.py --budgets 16 --prompts 2 --out "$RES"
fi
if [[ $PART == tiled7 ]]; then
  step pytest_graph_rest 280 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py \
    -k "sampled or vectorized or greedy_spec"
fi
if [[ $PART == tiled8 ]]; then
  step pytest_frag 200 $PYT tests/gpu/test_w4_frag_gpu.py
fi
if [[ $PART == wg ]]; then
  step pytest_wg 200 $PYT tests/gpu/test_w4_frag_gpu.py -k "wgmma" -s
  step bench_w4_frag 240 python3 bench/w4_frag.py --no-moe --ms 1,4,16,64 --out "$RES"
fi
if [[ $PART == wg2 ]]; then
  step pytest_frag 230 $PYT tests/gpu/test_w4_frag_gpu.py
  step bench_w4_frag 200 python3 bench/w4_frag.py --no-moe --ms 1,16,64,128,256 --out "$RES"
fi
if [[ $PART == wide ]]; then
  step bench_mla_wide 330 python3 bench/mla_attention.py --sweep-only --sweep-wide --no-peers --budget-s 200 \
    --out "$RES"
fi
if [[ $PART == wg3 ]]; then
  step pytest_frag_engine 150 $PYT tests/gpu/test_w4_frag_gpu.py -k "module or plan_token or dependent or demo"
  target_and_spec
  step bench_kernels 150 python3 bench/kernels.py --no-sweep --out "$RES"
fi
if [[ $PART == wg4 ]]; then
  step pytest_moe_wg 200 $PYT tests/gpu/test_w4_frag_gpu.py -k "moe"
  step bench_w4_frag 240 python3 bench/w4_frag.py --no-dense --ts 64,256,1024,2048 --out "$RES"
fi
if [[ $PART == wg5 ]]; then
  step pytest_frag 230 $PYT tests/gpu/test_w4_frag_gpu.py
  target_and_spec
fi
if [[ $PART == ring ]]; then
  step pytest_ring 240 $PYT tests/gpu/test_w4_frag_gpu.py -k "ring or moe_frag_batch_invariant or matches_reference_small or tiled_words"
  step bench_w4_frag 270 python3 bench/w4_frag.py --only ring --ms 1,4,16 --ts 1,4,16,64 --out "$RES"
fi
if [[ $PART == router5 ]]; then
  step pytest_router 150 $PYT tests/gpu/test_router_gemm_gpu.py
  step bench_router 120 python3 bench/router.py --out "$RES"
  step bench_w4_frag 120 python3 bench/w4_frag.py --only num_warps --no-moe --ms 16,64,256 --out "$RES"
  step bench_mla_wide 230 python3 bench/mla_attention.py --sweep-only --sweep-wide --sweep-n 64 --no-peers \
    --budget-s 170 --out "$RES"
fi
if [[ $PART == wide64 ]]; then
  step bench_mla_wide 170 python3 bench/mla_attention.py --sweep-only --sweep-wide --sweep-n 64 --no-peers \
    --budget-s 120 --out "$RES"
  step pytest_mla64 170 $PYT tests/gpu/test_mla_attention_gpu.py -k "(batch_invariant or vs_reference or causal_chunks) and 64 and not candidate"
  step bench_k2_step 240 python3 bench/k2_step.py --out "$RES"
fi
if [[ $PART == wg8 ]]; then
  step pytest_frag 230 $PYT tests/gpu/test_w4_frag_gpu.py
  step pytest_mla64 200 $PYT tests/gpu/test_mla_attention_gpu.py -k "(batch_invariant or vs_reference or causal_chunks or bit_equal) and 64 and not candidate"
  step bench_mla 120 python3 bench/mla_attention.py --no-peers --out "$RES"
fi
if [[ $PART == wg8b ]]; then
  step pytest_vsplit64 120 $PYT tests/gpu/test_mla_attention_gpu.py -k "v_split_by_t and 64-default"
  step bench_k2_step 260 python3 bench/k2_step.py --profile --out "$RES"
  step bench_kernels 200 python3 bench/kernels.py --no-sweep --out "$RES"
fi
if [[ $PART == warps8 ]]; then
  step bench_mla_wide 330 python3 bench/mla_attention.py --sweep-only --sweep-wide --no-peers --budget-s 250 \
    --out "$RES"
fi
if [[ $PART == final5 ]]; then
  step pytest_mla 240 $PYT tests/gpu/test_mla_attention_gpu.py -k "$MLA_BITEQ"
  target_and_spec
fi
if [[ $PART == moe8 ]]; then
  step pytest_moe8 150 $PYT tests/gpu/test_w4_frag_gpu.py -k "moe_frag_batch_invariant or moe_frag_matches_reference_small"
  step bench_w4_frag 150 python3 bench/w4_frag.py --only num_warps --no-dense --ts 256,1024,2048 --out "$RES"
fi
if [[ $PART == small ]]; then
  step bench_mla_small 200 python3 bench/mla_attention.py --sweep-only --sweep-small --no-peers --budget-s 150 \
    --out "$RES"
  step pytest_small 150 $PYT tests/gpu/test_mla_attention_gpu.py -k "small_trees"
  step bench_k2_step 240 python3 bench/k2_step.py --profile --out "$RES"
fi
if [[ $PART == small2 ]]; then
  step pytest_mla 200 $PYT tests/gpu/test_mla_attention_gpu.py -k "small_trees or (v_split_by_t and default) or (decode_rows_bit_equal and stages2) or (tree_batch_invariant and not candidate)"
  target_and_spec
  step bench_k2_step 150 python3 bench/k2_step.py --profile --out "$RES"
  step bench_mla_small 120 python3 bench/mla_attention.py --sweep-only --sweep-small --no-peers --budget-s 80 \
    --out "$RES"
fi
if [[ $PART == small3 ]]; then
  step bench_mla_small 200 python3 bench/mla_attention.py --sweep-only --sweep-small --no-peers --budget-s 160 \
    --out "$RES"
  step pytest_small 200 $PYT tests/gpu/test_mla_attention_gpu.py -k "small_trees"
fi
if [[ $PART == small4 ]]; then
  step bench_k2_step 120 python3 bench/k2_step.py --out "$RES"
  step bench_mla 110 python3 bench/mla_attention.py --no-peers --out "$RES"
  step pytest_mla 150 $PYT tests/gpu/test_mla_attention_gpu.py -k "(tree_batch_invariant or causal_batch_invariant or (v_split_by_t and default) or (decode_rows_bit_equal and stages2)) and not candidate"
  target_and_spec
fi
if [[ $PART == small5 ]]; then
  step bench_mla 130 python3 bench/mla_attention.py --no-peers --out "$RES"
  step pytest_mla 120 $PYT tests/gpu/test_mla_attention_gpu.py -k "(v_split_by_t and default) or (small_trees and default)"
  step bench_k2_step 120 python3 bench/k2_step.py --out "$RES"
fi
if [[ $PART == take ]]; then
  step bench_round 150 python3 bench/round.py --budgets 16 --prompts 2 --out "$RES"
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
  step pytest_graph 120 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
fi
if [[ $PART == chunk ]]; then
  step bench_mla_chunk 240 python3 bench/mla_attention.py --sweep-only --sweep-chunk --no-peers --budget-s 190 \
    --out "$RES"
  step bench_round 130 python3 bench/round.py --budgets 16 --prompts 2 --out "$RES"
fi
if [[ $PART == wgdec ]]; then
  step pytest_wgdec 200 $PYT tests/gpu/test_mla_attention_gpu.py -k "decode_warpgroup"
  step bench_mla_rows 200 python3 bench/mla_attention.py --sweep-only --sweep-rows --sweep-n 8 --no-peers \
    --budget-s 150 --out "$RES"
fi
if [[ $PART == wgdec2 ]]; then
  step pytest_wgdec 200 $PYT tests/gpu/test_mla_attention_gpu.py -k "decode_warpgroup or (small_trees and wg2)"
  step bench_mla_small 170 python3 bench/mla_attention.py --sweep-only --sweep-small --no-peers --budget-s 120 \
    --out "$RES"
  step bench_mla_rows 120 python3 bench/mla_attention.py --sweep-only --sweep-rows --no-peers --budget-s 80 \
    --out "$RES"
fi
if [[ $PART == wgfin ]]; then
  step bench_k2_step 120 python3 bench/k2_step.py --out "$RES"
  step bench_mla 130 python3 bench/mla_attention.py --no-peers --out "$RES"
  step pytest_spec_bitwise 150 $PYT $SPEC_BITWISE
fi
if [[ $PART == wgfin2 ]]; then
  step pytest_mla 260 $PYT tests/gpu/test_mla_attention_gpu.py -k "$MLA_BITEQ"
  step pytest_graph_triton 200 $PYT tests/gpu/test_graph_round_gpu.py -k triton_attention
fi
if [[ $PART == wgprof ]]; then
  step bench_k2_step 150 python3 bench/k2_step.py --nodes 1,4,8 --profile --out "$RES"
fi
if [[ $PART == wgq ]]; then
  step pytest_wgdec 150 $PYT tests/gpu/test_mla_attention_gpu.py -k "decode_warpgroup or (small_trees and wg2)"
  step bench_mla_rows 100 python3 bench/mla_attention.py --sweep-only --sweep-rows --sweep-n 8 --no-peers \
    --budget-s 60 --out "$RES"
fi
if [[ $PART == wgref ]]; then
  step pytest_wgref 200 $PYT tests/gpu/test_mla_attention_gpu.py -k "decode_warpgroup or (decode_rows_bit_equal and (stages2 or rows8))"
fi
if [[ $PART == wground ]]; then
  step bench_round 130 python3 bench/round.py --budgets 16 --prompts 2 --out "$RES"
  step pytest_graph 130 $PYT tests/gpu/test_graph_round_gpu.py tests/speculative/test_spec_gpu.py
fi
if [[ $PART == prof ]]; then
  step bench_round 150 python3 bench/round.py --budgets 16 --prompts 2 --out "$RES"
fi
ls -la "$RES"
