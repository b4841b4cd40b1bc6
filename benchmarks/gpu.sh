#!/usr/bin/env bash
# D2O's throughput experiment on one large GPU, as in the paper (Llama-3-8B, a 2048-token prompt and
# 8192 generated tokens, the full cache against D2O at 20% and H2O): random weights of Llama-3-8B's
# shape in bfloat16 (nothing to download). Decode steps are measured at five contexts from the prompt
# to prompt + generated for a batch sweep (`d2o bench decode`), then integrated into the tokens/s of
# the whole generation (`d2o bench throughput`). D2O and H2O hold 20% of the prompt as a token budget,
# so they hold the same at every context, as they do while generating, and evict in batches of
# EVICT_EVERY decode steps (8, the default of generate and serve; 1: at every step, as the paper).
# Markdown, JSON and PNG go to OUT.
#
#   benchmarks/gpu.sh [OUT]
#   SHAPE=tiny DEVICE=cpu DTYPE=float32 PROMPT=64 GENERATE=64 BATCHES=1,2 STEPS=2 benchmarks/gpu.sh /tmp/gpu
set -euo pipefail
OUT=${1:-out/gpu}
SHAPE=${SHAPE:-llama-3-8b}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
PROMPT=${PROMPT:-2048}
GENERATE=${GENERATE:-8192}
BATCHES=${BATCHES:-1,4,16}
STEPS=${STEPS:-16}
EVICT_EVERY=${EVICT_EVERY:-8}
D2O=${D2O:-d2o}
BUDGET="$((PROMPT / 5))t"
LENGTHS="$PROMPT"
for quarter in 1 2 3 4; do LENGTHS="$LENGTHS,$((PROMPT + GENERATE * quarter / 4))"; done
"$D2O" bench decode --shape "$SHAPE" --device "$DEVICE" --dtype "$DTYPE" --methods full,h2o,d2o \
  --budget "$BUDGET" --lengths "$LENGTHS" --batch "$BATCHES" --steps "$STEPS" --evict-every "$EVICT_EVERY" \
  --out "$OUT"
"$D2O" bench throughput --decode "$OUT/decode.json" --prompt "$PROMPT" --generate "$GENERATE" --out "$OUT"
