"""The exceptions that cross layers: bad usage (exit 2) and a peer's fault (counted, survived)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A flag, variable, TOML key or file a person gave has a bad value; the message is one line naming
    it and the value. The CLI prints it and exits 2."""
