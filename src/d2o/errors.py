"""The one exception type d2o raises for bad input: its message names the problem in one line."""


class D2OError(ValueError):
    """Bad input or an unsupported setting, explained in one line (the CLI prints it and exits with code 2)."""
