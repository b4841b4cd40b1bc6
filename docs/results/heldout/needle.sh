# The held-out needle (the original needle-in-a-haystack one), as d2o eval's --task-options; sourced by
# docs/results/heldout/run.sh and docs/results/heads/run.sh.
NEEDLE=(--task-option "needle=The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
        --task-option "question=What is the best thing to do in San Francisco?"
        --task-option "answer_prefix=The best thing to do in San Francisco is"
        --task-option "fact=eat a sandwich and sit in Dolores Park")
