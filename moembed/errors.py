"""One error type for everything a user can get wrong: the CLI prints its message on one line and exits 1."""


class MoembedError(Exception):
    """A user-facing error. The message names the file, line or key at fault."""
