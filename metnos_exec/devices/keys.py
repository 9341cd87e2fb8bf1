"""Keys: the server's Ed25519 signing key and the public keys a worker trusts.

`generate_key` writes a PKCS#8 PEM private key (mode 0600) and a one-line public key
``ed25519:<base64 of the 32 raw bytes>`` (``KEY.pub``); `load_public_key` takes that line
inline, or a file holding it or a PEM public key; `load_trust_keys` gathers a worker's
``--trust-key`` options and `TRUST_KEYS_ENV`. Ed25519 comes from the ``cryptography``
package (``pip install 'metnos-exec[device]'``), imported only when keys are used.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ..errors import BadConfig
from ..private import private_dir

if TYPE_CHECKING:  # pragma: no cover
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

__all__ = (
    "TRUST_KEYS_ENV",
    "PublicKey",
    "generate_key",
    "key_id",
    "load_public_key",
    "load_trust_keys",
)

#: Extra trusted public keys for a worker: comma-separated, each a file path or an inline
#: ``ed25519:BASE64`` key.
TRUST_KEYS_ENV: Final = "METNOS_TRUST_KEYS"

_INLINE_PREFIX = "ed25519:"

_INSTALL_HINT = "install the device extra: pip install 'metnos-exec[device]'"


@dataclass(frozen=True)
class PublicKey:
    """A trusted Ed25519 public key and where it came from (for messages)."""

    raw: bytes
    source: str

    @property
    def id(self) -> str:
        return key_id(self.raw)

    def verify(self, signature: bytes, data: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        key: Ed25519PublicKey = Ed25519PublicKey.from_public_bytes(self.raw)
        try:
            key.verify(signature, data)
        except InvalidSignature:
            return False
        return True


def key_id(raw_public: bytes) -> str:
    """A short, stable name for a public key: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(raw_public).hexdigest()[:16]


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
    except ImportError as exc:
        raise BadConfig(
            f"Ed25519 needs the cryptography package ({exc}); {_INSTALL_HINT}"
        ) from None
    return serialization


def generate_key(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write a new Ed25519 private key to `path` (PEM, mode 0600) and its public key to
    ``<path>.pub`` (one line, ``ed25519:<base64>``). Refuses to overwrite.

    Returns:
        (private key path, public key path).

    Raises:
        BadConfig: cryptography is not installed, or a key file already exists.
    """
    serialization = _crypto()
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    priv_path = Path(path)
    pub_path = priv_path.with_name(priv_path.name + ".pub")
    for p in (priv_path, pub_path):
        if p.exists():
            raise BadConfig(f"{p} already exists; refusing to overwrite a key")
    private_dir(priv_path.parent)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)  # exactly, whatever the umask
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub_path.write_text(_INLINE_PREFIX + base64.b64encode(raw).decode() + "\n")
    return priv_path, pub_path


def _load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    serialization = _crypto()
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise BadConfig(f"cannot read the signing key {path}: {exc.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise BadConfig(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BadConfig(f"{path} is not an Ed25519 key ({type(key).__name__})")
    return key


def load_public_key(spec: str) -> PublicKey:
    """A trusted key from an inline ``ed25519:BASE64`` or a file holding that line or a
    PEM public key.

    Raises:
        BadConfig: unreadable, malformed, or not Ed25519.
    """
    text = spec.strip()
    source = "inline key"
    if not text.startswith(_INLINE_PREFIX):
        source = text
        try:
            text = Path(text).read_text().strip()
        except OSError as exc:
            raise BadConfig(f"cannot read trust key {spec}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise BadConfig(f"trust key {spec} is not text (a public key file)") from None
    if text.startswith(_INLINE_PREFIX):
        try:
            raw = base64.b64decode(text[len(_INLINE_PREFIX) :].split()[0], validate=True)
        except (ValueError, IndexError):
            raise BadConfig(f"trust key {source}: not valid base64 after 'ed25519:'") from None
        if len(raw) != 32:
            raise BadConfig(f"trust key {source}: an Ed25519 key is 32 bytes, got {len(raw)}")
        _crypto()
        return PublicKey(raw=raw, source=source)
    serialization = _crypto()
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = serialization.load_pem_public_key(text.encode())
    except ValueError as exc:
        raise BadConfig(f"trust key {source}: not a public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise BadConfig(f"trust key {source}: not an Ed25519 key ({type(key).__name__})")
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return PublicKey(raw=raw, source=source)


def load_trust_keys(
    specs: Sequence[str] = (), environ: Mapping[str, str] | None = None
) -> tuple[PublicKey, ...]:
    """The keys of ``--trust-key`` options plus `TRUST_KEYS_ENV` (comma-separated).

    Raises:
        BadConfig: a key that cannot be loaded.
    """
    env = os.environ if environ is None else environ
    all_specs = [*specs, *(s for s in env.get(TRUST_KEYS_ENV, "").split(",") if s.strip())]
    keys: dict[bytes, PublicKey] = {}
    for spec in all_specs:
        key = load_public_key(spec)
        keys.setdefault(key.raw, key)
    return tuple(keys.values())
