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
    The CLI prints it on one line and exits 130."""
