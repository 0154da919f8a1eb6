"""User-facing errors. The CLI prints their message on one line and exits with code 2."""


class MemfitError(Exception):
    """A mistake in what the user asked for: bad input, an impossible combination, a missing file.

    The message must say what is wrong, what is accepted, and how to fix it.
    """


class ConfigError(MemfitError):
    """A run file, flag or config.json that does not validate."""


class IncompatibleError(MemfitError):
    """A combination of levers that the hardware or the engines cannot run."""


class TrainingInterrupted(BaseException):
    """Ctrl-C during training; the message says the step, the last checkpoint and how to resume.
    The CLI prints it on one line and exits with ``exit_code`` (130; 143 after a SIGTERM)."""

    def __init__(self, message: str = "", exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code
