#!/usr/bin/env bash
# NIAH at four more seeds (3, 4, 15, 16: haystacks no setting was chosen on), both protocols, for the full
# cache, the strongest baselines, D2O, d2o-plus with its merge ablations and -nowindow, the
# query-agnostic baselines (KVzip, Expected Attention) and d2o-novelty with its ablations: is what
# seed 0 shows a property of the method or of one seed? Each command resumes.
# Usage: bash docs/results/seeds/run.sh [SEED...]   (default: 3 4 15 16; about 12 min per seed on one thread)
set -euo pipefail
D2O=${D2O:-.venv/bin/d2o}
OUT=${OUT:-docs/results/seeds}
M=full,tova,snapkv,pyramidkv,roco,d2o,d2o-nomerge,d2o-plus,d2o-plus-nomerge,d2o-plus-nearmerge,d2o-plus-nowindow,d2o-plus-blend
M=$M,d2o-plus-blend-nomass,d2o-plus-blend-nearmerge,kvzip,expected-attention,d2o-novelty,d2o-novelty-uniform
M=$M,d2o-novelty-nomerge
NIAH="--task-option lengths=500,1000,2000 --task-option depths=0,0.25,0.5,0.75,1"
for seed in ${*:-3 4 15 16}; do
  for protocol in prompt context; do
    suffix=$([ "$protocol" = context ] && echo "-context" || true)
    $D2O eval --task niah $NIAH --limit 1 --seed "$seed" --methods $M --budgets 0.1,0.2,0.5 --protocol $protocol \
      --out "$OUT/seed$seed/niah$suffix"
  done
done
