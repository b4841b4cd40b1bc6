#!/usr/bin/env bash
# Tokens kept x bits per token at equal KV memory. No floor (--min-tokens 0): the budget alone sets
# the tokens kept, so that each combination's memory is what its budget and bits make it. The
# budgets of each bit width put it near 5%, 10% and 20% of the full float32 cache's bytes at 1,500
# tokens (K and V at 4 bits: 0.156 of float32 per token, at 8 bits 0.281, at 2 bits 0.094; the
# residual, 32 tokens per layer in float32, 2.2%). Each command resumes. `d2o frontier` reads them.
set -euo pipefail
D2O=${D2O:-.venv/bin/d2o}
OUT=${OUT:-docs/results/quantized}
NIAH="--task-option lengths=1000,2000 --task-option depths=0,0.25,0.5,0.75,1"
for spec in "none 0.05,0.1,0.2" "8 0.1,0.28,0.63" "4 0.18,0.5" "2 0.3,0.83"; do
  set -- $spec
  $D2O eval --task passkey --task-option length=1500 --limit 20 --seed 0 --methods d2o-plus,snapkv,h2o \
    --budgets $2 --min-tokens 0 --kv-bits $1 --out "$OUT/passkey-bits-$1"
  $D2O eval --task niah $NIAH --limit 2 --seed 0 --methods d2o-plus,snapkv,h2o --budgets $2 --min-tokens 0 \
    --kv-bits $1 --out "$OUT/niah-bits-$1"
done
# The question asked after compression, at the 5% level.
for spec in "none 0.05" "8 0.1" "4 0.18" "2 0.3"; do
  set -- $spec
  $D2O eval --task passkey --task-option length=1500 --limit 20 --seed 0 --methods d2o-novelty,d2o-plus,snapkv \
    --budgets $2 --min-tokens 0 --kv-bits $1 --protocol context --out "$OUT/passkey-context-bits-$1"
done
# Gemma 3 270M at 4K (pip install -e '.[gemma3]'): its 15 sliding-window layers hold 41% of the
# full cache's tokens whatever the budget, so only fewer bits bring it near 5%.
for spec in "none 0.05,0.1,0.2" "8 0.05,0.2" "4 0.05,0.2" "2 0.05,0.2"; do
  set -- $spec
  $D2O eval --model gemma3-270m --task passkey --task-option length=4096 --limit 5 --seed 0 \
    --methods d2o-plus,snapkv --budgets $2 --min-tokens 0 --kv-bits $1 --out "$OUT/gemma3-passkey-4096-bits-$1"
done
# The full cache at each bit width (its own memory point), in the same folders.
for bits in none 8 4 2; do
  $D2O eval --task passkey --task-option length=1500 --limit 20 --seed 0 --methods full --budgets 1.0 \
    --min-tokens 0 --kv-bits $bits --out "$OUT/passkey-bits-$bits"
  $D2O eval --task niah $NIAH --limit 2 --seed 0 --methods full --budgets 1.0 --min-tokens 0 --kv-bits $bits \
    --out "$OUT/niah-bits-$bits"
  $D2O eval --task passkey --task-option length=1500 --limit 20 --seed 0 --methods full --budgets 1.0 \
    --min-tokens 0 --kv-bits $bits --protocol context --out "$OUT/passkey-context-bits-$bits"
  $D2O eval --model gemma3-270m --task passkey --task-option length=4096 --limit 5 --seed 0 --methods full \
    --budgets 1.0 --min-tokens 0 --kv-bits $bits --out "$OUT/gemma3-passkey-4096-bits-$bits"
done
$D2O eval --task perplexity --task-option length=8192 --task-option chunk=64 --seed 0 --methods full --budgets 1.0 \
  --kv-bits 8 --out "$OUT/perplexity-bits-8"
$D2O frontier "$OUT"/passkey-bits-* "$OUT"/niah-bits-* "$OUT"/passkey-context-bits-* "$OUT"/gemma3-passkey-4096-bits-* \
  --plot "$OUT/frontier.png"
