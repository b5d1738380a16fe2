"""A node's identity: an Ed25519 key pair kept in a file; the node id is derived from the public key.

Deriving the id from the key means nobody can announce on behalf of another node: a DHT entry carries the
publisher's public key and its signature, and a reader recomputes the id from the key.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

NODE_ID_BYTES = 20  # Kademlia's 160-bit id space
PUBLIC_KEY_BYTES = 32


def node_id_from_public_key(public_key: bytes) -> bytes:
    """The 20-byte node id of a raw Ed25519 public key (sha256, truncated)."""
    return hashlib.sha256(b"swarmnode-node-id\x00" + public_key).digest()[:NODE_ID_BYTES]


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when ``signature`` is the holder of ``public_key``'s signature over ``message``."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Identity:
    """An Ed25519 signing key and the node id derived from it."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: Path) -> Identity:
        """Load the key at ``path`` (raw 32-byte seed, mode 0600), creating it the first time."""
        if path.exists():
            seed = path.read_bytes()
            if len(seed) != 32:
                raise ValueError(f"identity file {path} is not a 32-byte Ed25519 key")
            return cls(Ed25519PrivateKey.from_private_bytes(seed))
        identity = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.seed)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return identity

    @property
    def seed(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    @property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def node_id(self) -> bytes:
        return node_id_from_public_key(self.public_key)

    @property
    def node_id_hex(self) -> str:
        return self.node_id.hex()

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)
