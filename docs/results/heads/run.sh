#!/usr/bin/env bash
# Budgets per KV head (heads=adaptive) on the committed sets, against the committed even rows
# (docs/results/{niah,passkey}*, docs/results/heldout/*: the same samples and seeds). Each command
# resumes where it stopped. Run from the repository root after `make setup`.
set -euo pipefail
D2O=${D2O:-.venv/bin/d2o}
OUT=${OUT:-docs/results/heads}
M=snapkv,pyramidkv,kvzip,expected-attention
A=""
for method in ${M//,/ }; do A="$A --option $method.heads=adaptive"; done
B=0.1,0.2,0.5
NIAH="--task-option lengths=500,1000,2000 --task-option depths=0,0.25,0.5,0.75,1"
for protocol in context prompt; do
  suffix=$([ "$protocol" = context ] && echo "-context" || true)
  $D2O eval --task niah $NIAH --limit 1 --seed 0 --methods $M $A --budgets $B --protocol $protocol \
    --out "$OUT/niah$suffix"
  $D2O eval --task passkey --task-option length=1500 --limit 20 --seed 0 --methods $M $A --budgets $B \
    --protocol $protocol --out "$OUT/passkey$suffix"
done
# The held-out sets (docs/results/heldout/run.sh): another haystack and another needle, seed 2.
NEEDLE=(--task-option "needle=The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
        --task-option "question=What is the best thing to do in San Francisco?"
        --task-option "answer_prefix=The best thing to do in San Francisco is"
        --task-option "fact=eat a sandwich and sit in Dolores Park")
for protocol in context prompt; do
  suffix=$([ "$protocol" = context ] && echo "-context" || true)
  $D2O eval --task niah "${NEEDLE[@]}" --task-option lengths=500,1000,2000 --task-option depths=0,0.25,0.5,0.75,1 \
    --limit 1 --seed 2 --methods $M $A --budgets $B --protocol $protocol --out "$OUT/niah-sf$suffix"
  $D2O eval --task passkey --task-option length=1500 --task-option haystack=/usr/share/common-licenses/GPL-3 \
    --limit 10 --seed 2 --methods $M $A --budgets $B --protocol $protocol --out "$OUT/passkey-gpl$suffix"
done
# RULER's 11 answered tasks on SmolLM2 at 1K, asked after compression (docs/results/ruler/run.sh's rows of these methods).
$D2O eval --task ruler --task-option length=1024 --limit 5 --seed 0 --protocol context \
  --methods kvzip,snapkv,expected-attention --option kvzip.heads=adaptive --option snapkv.heads=adaptive \
  --option expected-attention.heads=adaptive --budgets 0.1,0.25,0.5 --out "$OUT/ruler-smollm2-1k-context"
# The methods that evict at every decode step and merge, adaptive, into evicting/ (the same sets and seeds).
E=d2o-novelty,d2o-plus-words
EA="--option d2o-novelty.heads=adaptive --option d2o-plus-words.heads=adaptive"
for protocol in context prompt; do
  suffix=$([ "$protocol" = context ] && echo "-context" || true)
  $D2O eval --task niah $NIAH --limit 1 --seed 0 --methods $E $EA --budgets $B --protocol $protocol \
    --out "$OUT/evicting/niah$suffix"
  $D2O eval --task niah "${NEEDLE[@]}" $NIAH --limit 1 --seed 2 --methods $E $EA --budgets $B --protocol $protocol \
    --out "$OUT/evicting/niah-sf$suffix"
  $D2O eval --task passkey --task-option length=1500 --limit 20 --seed 0 --methods $E $EA --budgets $B \
    --protocol $protocol --out "$OUT/evicting/passkey$suffix"
  $D2O eval --task passkey --task-option length=1500 --task-option haystack=/usr/share/common-licenses/GPL-3 \
    --limit 10 --seed 2 --methods $E $EA --budgets $B --protocol $protocol --out "$OUT/evicting/passkey-gpl$suffix"
done
# Without the floor per layer (--min-tokens 0): kvzip adaptive and d2o-novelty, asked after compression.
for method in kvzip d2o-novelty; do
  K="--methods $method --budgets 0.1,0.2 --min-tokens 0 --protocol context"
  [ "$method" = kvzip ] && K="$K --option kvzip.heads=adaptive"
  F="$OUT/$method-min-tokens0"
  $D2O eval --task passkey --task-option length=1500 --limit 20 --seed 0 $K --out "$F/passkey-context"
  $D2O eval --task passkey --task-option length=1500 --task-option haystack=/usr/share/common-licenses/GPL-3 \
    --limit 10 --seed 2 $K --out "$F/passkey-gpl-context"
  $D2O eval --task niah $NIAH --limit 1 --seed 0 $K --out "$F/niah-context"
  $D2O eval --task niah "${NEEDLE[@]}" $NIAH --limit 1 --seed 2 $K --out "$F/niah-sf-context"
done
$D2O eval --task ruler --task-option length=1024 --limit 5 --seed 0 --protocol context --methods kvzip \
  --option kvzip.heads=adaptive --budgets 0.1,0.25,0.5 --min-tokens 0 --out "$OUT/kvzip-min-tokens0/ruler-smollm2-1k-context"
# kvzip (adaptive) at kvpress's count on the short NIAH prompts: 128 tokens in every layer.
$D2O eval --task niah --task-option lengths=500,1000 --task-option depths=0,0.25,0.5,0.75,1 --limit 1 --seed 0 \
  --methods kvzip --option kvzip.heads=adaptive --budgets 128t --protocol context --out "$OUT/kvzip-128t/niah-context"
# The same kvzip (adaptive, no floor) with keys and values at 4 bits: runs of packed vectors.
K="--methods kvzip --budgets 0.1,0.2 --min-tokens 0 --protocol context --option kvzip.heads=adaptive --kv-bits 4"
$D2O eval --task passkey --task-option length=1500 --limit 20 --seed 0 $K --out "$OUT/kvzip-min-tokens0-4bit/passkey-context"
$D2O eval --task niah $NIAH --limit 1 --seed 0 $K --out "$OUT/kvzip-min-tokens0-4bit/niah-context"
