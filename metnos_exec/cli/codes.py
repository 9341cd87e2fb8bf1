"""``metnos-exec codes``: every error code (``E_...``) and what it means
(`errors.ERROR_CODES`)."""

from __future__ import annotations

import argparse
import sys

from ..errors import ERROR_CODES
from ._common import Subparsers, _dump_json, _Formatter


def _cmd_codes(ns: argparse.Namespace) -> int:
    if ns.json:
        _dump_json(ERROR_CODES, sys.stdout)
        return 0
    width = max(map(len, ERROR_CODES))
    sys.stdout.write(
        "".join(f"{code:<{width}}  {meaning}\n" for code, meaning in ERROR_CODES.items())
    )
    return 0


def register(subparsers: Subparsers) -> None:
    """Add ``codes`` (no broker: it takes neither ``--broker`` nor the epilog)."""
    co = subparsers.add_parser(
        "codes",
        help="list the error codes (E_...) and what they mean",
        description="Every error code a result, dead letter or log record may carry.",
        formatter_class=_Formatter,
    )
    co.add_argument("--json", action="store_true", help="as one JSON object")
    co.set_defaults(fn=_cmd_codes)
