"""The error the user can fix: train_grpo.py prints it as one line on stderr and exits 2."""


class UserError(Exception):
    """Bad input from the user (config, paths, data). train_grpo prints it as one line, exit 2."""
