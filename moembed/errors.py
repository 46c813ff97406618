"""One error type for everything a user can get wrong: the CLI prints its message on one line and exits 1."""


class MoembedError(Exception):
    """A user-facing error. The message names the file, line or key at fault."""


def config_error(e, where: str, key_prefix: str = "") -> MoembedError:
    """A one-line MoembedError `where: key.path: message` from a pydantic ValidationError (its first error)."""
    errors = e.errors()
    err = errors[0]
    key = key_prefix + ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return MoembedError(f"{where}: {key}: {msg}{more}")
