"""Errors a user can cause. The CLI and the stage entry turn each into one line and an exit code."""


class UserError(Exception):
    """A mistake in the user's config, data or invocation; printed as one line, never a traceback."""

    exit_code = 1


class ConfigError(UserError):
    """Invalid config: unknown key, wrong type, impossible combination. Raised before anything starts."""

    exit_code = 2


class DataError(UserError):
    """Bad input data: missing file, malformed row (named by file and line), empty corpus."""


class InputError(UserError):
    """A stage's input stage has no complete output to consume."""
