#!/usr/bin/env bash
# One device call: the GPU tests and the benchmarks, logs and results packed under $OUT.
#   bash scripts/gpu_suite.sh            (on the GPU machine, from the repository root)
# Each step has its own time cap so one slow step cannot take the rest with it; the results tarball
# is rebuilt after every step.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-out/gpu}
RES=$OUT/results
mkdir -p "$RES"
pack() { tar -C "$RES" -cf "$OUT/results.tar" . ; }
step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  echo "== $name (cap ${secs}s): $*"
  timeout "$secs" "$@" > "$RES/$name.log" 2>&1; echo "rc=$?" >> "$RES/$name.log"
  tail -4 "$RES/$name.log"; pack
}
nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
step pytest_gpu 300 python3 -m pytest -m gpu tests -q -p no:cacheprovider
step bench_kernels 150 python3 bench/kernels.py --no-sweep --out "$RES"
step bench_mla 80 python3 bench/mla_attention.py --out "$RES"
step bench_gemm 90 python3 bench/gemm.py --out "$RES"
step bench_k2_step 240 python3 bench/k2_step.py --out "$RES"
step bench_round 180 python3 bench/round.py --out "$RES"
step bench_spec 240 python3 -m kdtree_engine.bench_spec --device cuda --out "$RES"
ls -la "$RES"
