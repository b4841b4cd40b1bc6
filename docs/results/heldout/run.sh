#!/usr/bin/env bash
# The held-out check: the settings of d2o-plus and d2o-novelty were chosen on development seeds (1, and 5
# for d2o-novelty) of the passkey and NIAH tasks and a development text;
# here the methods meet data none of them was tuned on: a passkey hidden in the GNU GPL v3 (legal
# text, not essays; Debian's /usr/share/common-licenses/GPL-3) and another needle (the original
# needle-in-a-haystack one) in the essays, at another seed, in both protocols; and the perplexity of
# the GPL's first 4,096 tokens (the settings' merge was chosen on the essays' text). Each command resumes.
set -euo pipefail
D2O=${D2O:-.venv/bin/d2o}
OUT=${OUT:-docs/results/heldout}
M=full,h2o,tova,snapkv,pyramidkv,roco,sirllm,d2o,d2o-nomerge,d2o-plus,d2o-plus-words,d2o-plus-nomerge,d2o-plus-nearmerge
M=$M,d2o-plus-nowindow
M=$M,d2o-plus-blend,d2o-plus-blend-nomass,d2o-plus-blend-nearmerge
M=$M,d2o-plus-recent,kvzip,expected-attention,d2o-novelty,d2o-novelty-uniform,d2o-novelty-nomerge
B=0.1,0.2,0.5
NEEDLE=(--task-option "needle=The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
        --task-option "question=What is the best thing to do in San Francisco?"
        --task-option "answer_prefix=The best thing to do in San Francisco is"
        --task-option "fact=eat a sandwich and sit in Dolores Park")
for protocol in prompt context; do
  suffix=$([ "$protocol" = context ] && echo "-context" || true)
  $D2O eval --task passkey --task-option length=1500 --task-option haystack=/usr/share/common-licenses/GPL-3 \
    --limit 10 --seed 2 --methods $M --budgets $B --protocol $protocol --out "$OUT/passkey-gpl$suffix"
  $D2O eval --task niah "${NEEDLE[@]}" --task-option lengths=500,1000,2000 --task-option depths=0,0.25,0.5,0.75,1 \
    --limit 1 --seed 2 --methods $M --budgets $B --protocol $protocol --out "$OUT/niah-sf$suffix"
done
# Perplexity: the best baselines of the committed text, D2O and d2o-plus (SnapKV and PyramidKV compress
# once, after the prefill, so never a stream).
P=full,streamingllm,h2o,tova,roco,sirllm,d2o,d2o-nomerge,d2o-plus,d2o-plus-nomerge,d2o-plus-recent,d2o-novelty
P=$P,d2o-novelty-uniform,d2o-novelty-nomerge
$D2O eval --task perplexity --task-option text=/usr/share/common-licenses/GPL-3 --task-option length=4096 \
  --task-option chunk=64 --seed 2 --methods $P --budgets $B --out "$OUT/perplexity-gpl"
