#!/usr/bin/env bash
# The committed results on the embedded model, every method at 0.1, 0.2 and 0.5, both protocols:
# the whole prompt compressed (default), and the context compressed before the question is fed.
# Each command resumes where it stopped. Run from the repository root after `make setup`.
set -euo pipefail
D2O=${D2O:-.venv/bin/d2o}
OUT=${OUT:-docs/results}
M=full,local,streamingllm,h2o,tova,snapkv,pyramidkv,cam,roco,sirllm,d2o,d2o-nomerge,d2o-official,d2o-plus,d2o-plus-words
M=$M,d2o-plus-nomerge,d2o-plus-nearmerge,d2o-plus-blend,d2o-plus-blend-nomass,d2o-plus-blend-nearmerge,d2o-plus-papermerge
M=$M,d2o-plus-countmerge,d2o-plus-nowindow,d2o-plus-nosurprisal,d2o-plus-uniform,d2o-plus-sumvotes,d2o-plus-noreach
M=$M,d2o-plus-recent,kvzip,expected-attention,d2o-novelty,d2o-novelty-uniform,d2o-novelty-nomerge
B=0.1,0.2,0.5
NIAH="--task-option lengths=500,1000,2000 --task-option depths=0,0.25,0.5,0.75,1"
# d2o-official compresses at the first decode step, which under --protocol context is the question's
# pass: it is refused there (its compression would see the question).
C=${M/,d2o-official/}
for protocol in prompt context; do
  suffix=$([ "$protocol" = context ] && echo "-context" || true)
  methods=$([ "$protocol" = context ] && echo "$C" || echo "$M")
  $D2O eval --task passkey --task-option length=1500 --limit 20 --seed 0 --methods $methods --budgets $B \
    --protocol $protocol --out "$OUT/passkey$suffix"
  $D2O eval --task niah $NIAH --limit 1 --seed 0 --methods $methods --budgets $B --protocol $protocol \
    --out "$OUT/niah$suffix"
done
# Several needles in one haystack, asked one by one of one compressed context.
$D2O eval --task niah --task-option needles=8 --task-option lengths=1000,2000 --limit 2 --seed 0 --protocol context \
  --methods full,d2o-novelty,d2o-plus,kvzip,expected-attention,pyramidkv,snapkv,h2o,d2o --budgets $B \
  --out "$OUT/niah-needles-context"
# Perplexity for the main methods, the d2o-plus merge ablations and d2o-novelty's (the others are judged on the
# retrieval tasks).
P=full,local,streamingllm,h2o,tova,snapkv,pyramidkv,cam,roco,sirllm,d2o,d2o-nomerge,d2o-official,d2o-plus,d2o-plus-words
P=$P,d2o-plus-nomerge,d2o-plus-nearmerge,d2o-plus-blend,d2o-plus-blend-nomass,d2o-plus-blend-nearmerge,d2o-plus-countmerge
P=$P,d2o-plus-recent,kvzip,expected-attention,d2o-novelty,d2o-novelty-uniform,d2o-novelty-nomerge
$D2O eval --task perplexity --task-option length=8192 --task-option chunk=64 --seed 0 --methods $P --budgets $B \
  --out "$OUT/perplexity"
