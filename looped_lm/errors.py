"""The one exception type for bad user input.

Anything the user can get wrong (a config key, a file, a flag) raises `UserError` with one line
that names the problem. The CLI prints it as `error: <message>` and exits with code 2; no
traceback ever reaches the user for bad input.
"""


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""

    exit_code = 2
