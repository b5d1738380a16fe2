"""The exceptions that cross layers: bad usage (exit 2) and a peer's fault (counted, survived)."""

from __future__ import annotations

from swarmnode.util.labels import FetchFailure


class ConfigError(ValueError):
    """A flag, variable, TOML key or file a person gave has a bad value; the message is one line naming
    it and the value. The CLI prints it and exits 2."""


class StateNotSaved(RuntimeError):
    """The node stopped, but the state it stopped at is not on disk: a restart loses work. The message
    is one line naming the newest step on disk; the CLI prints it and exits 1."""


class PeerFault(Exception):
    """Something a peer did, or failed to do: it is counted by `reason` (one of `labels.FetchFailure`),
    logged once and survived. Anything else that goes wrong while talking to a peer is a bug here:
    logged with its traceback and counted as `internal`, never dressed up as the peer's fault."""

    def __init__(self, reason: FetchFailure, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class RankFailed(RuntimeError):
    """A training rank of this node died, hung past the process group's timeout or broke a collective
    (`core/ranks.py`): the node stops (exit 1, one line) and its restart resumes from its snapshot."""
