#!/usr/bin/env bash
# Gemma 3 270M (base, hybrid sliding/global attention) at 2K-8K tokens, at 0.05, 0.1 and 0.2:
# passkey at 2,048 / 4,096 / 8,192 tokens and needle in a haystack at the three lengths x 5 depths
# with the whole prompt compressed; passkey at 4,096 and 8,192 with the context compressed before
# the question is fed; the perplexity of 8,192 tokens at 0.1; NIAH with the context compressed.
# (Nine methods and these runs: what one core did in about 100 minutes.)
# Needs `.venv/bin/pip install -e '.[gemma3]'`. Each command resumes.
set -euo pipefail
D2O=${D2O:-.venv/bin/d2o}
OUT=${OUT:-docs/results/gemma3-270m}
M=full,streamingllm,h2o,tova,snapkv,pyramidkv,sirllm,d2o,d2o-plus,d2o-plus-nomerge
G="--model gemma3-270m --seed 0 --methods $M --budgets 0.05,0.1,0.2"
NIAH="--task-option lengths=2048,4096,8192 --task-option depths=0,0.25,0.5,0.75,1 --limit 1"
for length in 2048 4096 8192; do
  $D2O eval --task passkey --task-option length=$length --limit 5 $G --out "$OUT/passkey-$length"
done
$D2O eval --task niah $NIAH $G --out "$OUT/niah"
for length in 4096 8192; do
  $D2O eval --task passkey --task-option length=$length --limit 5 $G --protocol context \
    --out "$OUT/passkey-$length-context"
done
$D2O eval --task perplexity --task-option length=8192 --task-option chunk=64 --model gemma3-270m --seed 0 \
  --methods full,streamingllm,h2o,tova,sirllm,d2o,d2o-plus,d2o-plus-nomerge --budgets 0.1 --out "$OUT/perplexity"
$D2O eval --task niah $NIAH $G --protocol context --out "$OUT/niah-context"
