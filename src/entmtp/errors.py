"""Error types. Every message names the bad value and says how to fix it."""


class EntMTPError(ValueError):
    """Base class for user-facing errors (bad input, bad files, bad configuration)."""


class FieldError(EntMTPError):
    """A value of one named field (of a request, of `GenerationOptions`) that cannot be used; `field` names it
    where the raiser knows it (the server's 400 reports it as `param`)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class TreeError(EntMTPError):
    """A tree (list of top-k rank paths) is malformed or does not fit the heads."""


class HeadsError(EntMTPError):
    """A heads checkpoint is missing, corrupt, or does not fit the base model."""


class PromptError(EntMTPError):
    """A prompt or generation length is unusable (empty, too long for the context window, ...)."""


class DataError(EntMTPError):
    """Training data (prompt files, shards, output directories) is missing or unusable."""
