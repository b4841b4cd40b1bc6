#!/usr/bin/env bash
# SimilarityMerge's options beyond the paper, each alone on D2O and all together, at budget 0.2 on
# the committed tasks (seed 0, both protocols) and perplexity; `d2o` and `d2o-nomerge` themselves
# are in docs/results. One folder per variant (the options are part of a folder's configuration).
# Usage: bash docs/results/merge-options/run.sh [VARIANT...]   (default: all; each command resumes)
set -euo pipefail
D2O=${D2O:-.venv/bin/d2o}
OUT=${OUT:-docs/results/merge-options}
declare -A OPTIONS=(
  [mass]="merge.mass=true"
  [values_only]="merge.values_only=true"
  [normalized]="merge.weighting=normalized"
  [max_merges]="merge.max_merges=1"
  [skip]="merge.skip_first=4 merge.skip_newest=1"
  [min_distance]="merge.min_distance=8"
  [mass_only]="merge.mass=true merge.blend=false"
  [together]="merge.mass=true merge.values_only=true merge.weighting=normalized merge.max_merges=1 merge.skip_first=4 merge.skip_newest=1"
)
NIAH="--task-option lengths=500,1000,2000 --task-option depths=0,0.25,0.5,0.75,1"
VARIANTS=${*:-mass values_only normalized max_merges skip min_distance mass_only together}
for variant in $VARIANTS; do
  opts=()
  for option in ${OPTIONS[$variant]}; do opts+=(--option "d2o.$option"); done
  for protocol in prompt context; do
    suffix=$([ "$protocol" = context ] && echo "-context" || true)
    $D2O eval --task passkey --task-option length=1500 --limit 20 --seed 0 --methods d2o --budgets 0.2 \
      --protocol $protocol --out "$OUT/$variant/passkey$suffix" "${opts[@]}"
    $D2O eval --task niah $NIAH --limit 1 --seed 0 --methods d2o --budgets 0.2 --protocol $protocol \
      --out "$OUT/$variant/niah$suffix" "${opts[@]}"
  done
  $D2O eval --task perplexity --task-option length=8192 --task-option chunk=64 --seed 0 --methods d2o --budgets 0.2 \
    --out "$OUT/$variant/perplexity" "${opts[@]}"
done
