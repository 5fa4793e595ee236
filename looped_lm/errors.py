"""The exception types a user sees as one line: bad input (`UserError`) and a failure mid-run (`RunFailure`).

Anything the user can get wrong (a config key, a file, a flag, a request field) raises `UserError` with
one line that names the problem. The CLI prints it as `error: <message>` and exits with code 2; the
server answers 400 with `param` naming the request field. No traceback ever reaches the user for bad
input.
"""


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2 (HTTP 400 with `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RunFailure(Exception):
    """A failure mid-run that is not bad input (a full disk, a read-only file system, a non-finite step): one
    line, exit code 1."""
