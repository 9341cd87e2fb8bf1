"""Signing executors: ``keygen`` (an Ed25519 key pair) and ``sign`` (an executor folder's
``manifest.sig``), for workers that verify them with ``--trust-key``
(`metnos_exec.devices.signing`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from ..errors import MetnosError
from ._common import EXIT, Subparsers, _Exit, _Formatter


def _cmd_keygen(ns: argparse.Namespace) -> int:
    from ..devices.signing import generate_key, key_id, load_public_key

    folder = Path(ns.out).absolute().parent
    if not folder.is_dir():
        # A mistyped --out must not make folders (the Python API makes the key's own
        # folder private: asked for, there).
        raise _Exit(EXIT["usage"], f"--out {ns.out}: no folder {folder} (make it first)")
    try:
        priv, pub = generate_key(ns.out)
    except MetnosError as exc:
        raise _Exit(EXIT["usage"], str(exc)) from None
    except OSError as exc:
        raise _Exit(EXIT["usage"], f"cannot write {ns.out}: {exc.strerror}") from None
    kid = key_id(load_public_key(str(pub)).raw)
    sys.stdout.write(
        f"private key: {priv} (keep it secret; sign with --key {priv})\n"
        f"public key:  {pub} (key id {kid}; give it to workers: --trust-key {pub})\n"
    )
    return 0


def _cmd_sign(ns: argparse.Namespace) -> int:
    from ..devices.signing import SignatureFile, sign_folder

    try:
        out = sign_folder(ns.folder, ns.key)
    except MetnosError as exc:
        raise _Exit(EXIT["usage"], str(exc)) from None
    sig = msgspec.json.decode(out.read_bytes(), type=SignatureFile)
    sys.stdout.write(f"signed {len(sig.files)} files with key {sig.key_id}: {out}\n")
    return 0


def register(subparsers: Subparsers) -> None:
    """Add ``keygen`` and ``sign`` (no broker: neither takes ``--broker`` nor the epilog)."""
    kg = subparsers.add_parser(
        "keygen",
        help="make an Ed25519 key pair for signing executors",
        description="Write a new Ed25519 private key to OUT (PEM, mode 0600) and its "
        "public key to OUT.pub (one line, ed25519:BASE64), for `sign` and "
        "`worker --trust-key`. Needs the device extra (cryptography).",
        formatter_class=_Formatter,
    )
    kg.add_argument("--out", required=True, metavar="OUT", help="private key file to create")
    kg.set_defaults(fn=_cmd_keygen)

    sg = subparsers.add_parser(
        "sign",
        help="sign an executor folder",
        description="Hash every file of the executor folder (sorted relative paths, "
        "SHA-256, no timestamps; symbolic links and special files refused) and write "
        "the Ed25519 signature to FOLDER/manifest.sig. Re-sign after any change.",
        formatter_class=_Formatter,
    )
    sg.add_argument("folder", metavar="FOLDER", help="the executor folder (with manifest.toml)")
    sg.add_argument("--key", required=True, metavar="KEY", help="private key (from keygen)")
    sg.set_defaults(fn=_cmd_sign)
