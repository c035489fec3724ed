"""User-facing errors: the CLI turns these into one line on stderr and exit code 2."""


class UserError(Exception):
    """Bad input from the user (paths, scenes, config, flags, devices). Never a bug."""
