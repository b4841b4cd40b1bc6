"""``python -m d2o``: the d2o command."""

from d2o.cli import main

main()
