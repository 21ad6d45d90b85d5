"""The two ways a command ends early, each reported in one line: a configuration refused before any work
starts (ConfigError), or a run that cannot go on (RunError)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and the value."""


class RunError(RuntimeError):
    """A run cannot go on (a damaged checkpoint, numbers that stopped being finite, a failed save): the
    command reports it in one line and exits non-zero."""
