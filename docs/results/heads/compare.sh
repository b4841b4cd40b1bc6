#!/usr/bin/env bash
# Adaptive against even, paired sample by sample: each set alone, then the committed and held-out
# folders pooled. Run from the repository root after docs/results/heads/run.sh.
set -euo pipefail
D2O=${D2O:-.venv/bin/d2o}
HEADS=docs/results/heads
for task in niah:niah-sf passkey:passkey-gpl; do
  committed=${task%%:*}; heldout=${task##*:}
  for protocol in "" "-context"; do
    for method in snapkv pyramidkv kvzip expected-attention; do
      $D2O compare "$HEADS/$committed$protocol" "$HEADS/$heldout$protocol" --method "$method" --against "$method" \
        --against-results "docs/results/$committed$protocol" --against-results "docs/results/heldout/$heldout$protocol"
    done
  done
done
# The methods that evict while decoding (evicting/), against the same committed even rows.
for task in niah:niah-sf passkey:passkey-gpl; do
  committed=${task%%:*}; heldout=${task##*:}
  for protocol in "" "-context"; do
    for method in d2o-novelty d2o-plus-words; do
      $D2O compare "$HEADS/evicting/$committed$protocol" "$HEADS/evicting/$heldout$protocol" --method "$method" \
        --against "$method" --against-results "docs/results/$committed$protocol" \
        --against-results "docs/results/heldout/$heldout$protocol"
    done
  done
done
