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


class StageFailed(UserError):
    """A stage process exited non-zero; its output stays incomplete and is never consumed."""


class StorageError(UserError):
    """The run root (or a file a stage writes) cannot be written: read-only, no permission, or full."""


STORAGE_ERRNOS = {13: "no permission", 1: "not permitted", 30: "read-only file system", 28: "no space left",
                  122: "disk quota exceeded"}  # EACCES, EPERM, EROFS, ENOSPC, EDQUOT


def storage_error(e: OSError) -> StorageError | None:
    """The user-facing error for an OSError a full, read-only or forbidden run root causes (None for others)."""
    if e.errno not in STORAGE_ERRNOS:
        return None
    hint = "free some space and run again: finished steps and checkpoints are kept" if e.errno in (28, 122) else \
        "make it writable or set run.root to a folder you can write"
    return StorageError(f"cannot write {e.filename or 'the run root'}: {STORAGE_ERRNOS[e.errno]} ({hint})")
