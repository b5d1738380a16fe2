"""`swarmnode identity`: a node's id before it ever runs, and a certificate request that names it, so an
operator can have the node's mutual-TLS certificate signed first (docs/design.md "Trust": a node's
certificate must name its node id as its common name)."""

from __future__ import annotations

from pathlib import Path

from swarmnode.net.identity import Identity
from swarmnode.net.security import certificate_request


def identity_command(key_path: Path, csr: Path | None, tls_key: Path | None, names: tuple[str, ...]) -> int:
    """Prints the node id of the key at `key_path` (creating the key the first time, as `run` would);
    with `csr`, writes a certificate signing request whose CN is that id, signed by `tls_key` (default: the
    request's path with the suffix .key; created when absent). ValueError (exit 2) for a bad key file."""
    try:
        identity = Identity.load_or_create(key_path)
    except OSError as exc:
        raise ValueError(
            f"--data-dir/--identity: cannot read or create {str(key_path)!r}: {exc.strerror}"
        ) from None
    print(identity.node_id_hex)
    if csr is not None:
        key = tls_key if tls_key is not None else csr.with_suffix(".key")
        request = certificate_request(identity.node_id_hex, key, names)
        csr.write_bytes(request)
        print(f"certificate request (CN {identity.node_id_hex}) written to {csr}; its TLS key is {key}")
    return 0
