"""Errors a user can cause, and the exit codes scripts can trust."""

# Exit codes, the same for every command.
OK = 0
FAILED = 1  # the thing checked is not good: a smoke check failed, an arch is not covered, a build failed
USAGE = 2  # bad input: invalid manifest, unknown image, unreachable registry, missing tool
UNKNOWN = 3  # could not tell (inspect found no CUDA information)


class UserError(Exception):
    """An error the user can fix. Printed as one line, never with a traceback."""

    exit_code = USAGE
