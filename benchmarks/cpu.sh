#!/usr/bin/env bash
# The CPU benchmarks committed in docs/benchmarks/ (embedded model, float32), each command's table
# in OUT/{decode,fit,prefill,prefill-long,prefill-query-agnostic}.md with its JSON and plots. Ratios are measured side by
# side in one process; run it on an otherwise idle machine.
set -euo pipefail
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1  # one thread per process, as every committed run
OUT=${1:-docs/benchmarks}
D2O=${D2O:-.venv/bin/d2o}
$D2O bench decode --methods full,h2o,snapkv,streamingllm,d2o,d2o-plus --lengths 1024,4096,8000 --batch 1,8 \
  --steps 32 --out "$OUT/decode"
$D2O bench decode --methods full,d2o --lengths 1024,4096 --batch 16 --steps 16 --out "$OUT/decode-batch16"
# A cap that holds 4 full sequences of 2048 + 512 tokens (30 layers x 2560 tokens x 1536 bytes each).
$D2O bench fit --kv-memory 472MB --prompt 2048 --generate 512 --methods full,h2o,d2o,d2o-plus --out "$OUT/fit"
$D2O bench prefill --lengths 1024,2048,4096,8192 --repeats 2 --out "$OUT/prefill"
$D2O bench prefill --shape smollm2 --lengths 16384,32768 --out "$OUT/prefill-long"
$D2O bench prefill --lengths 1024,4096 --repeats 3 --methods d2o,d2o-plus,kvzip,expected-attention,d2o-novelty \
  --out "$OUT/prefill-query-agnostic"
