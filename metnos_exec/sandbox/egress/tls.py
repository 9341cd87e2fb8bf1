"""The one look the wall takes inside a TLS connection: the ClientHello's SNI.

No decryption. A connection allowed for ``api.example.com`` whose ClientHello asks the
server for another name (``server_name``) is refused: that narrows domain fronting (one
allowed front, another host behind it on the same CDN). Read from the first bytes the
job sends, before anything reaches the host.
"""

from __future__ import annotations

from typing import Literal

__all__ = ("Hello", "client_hello")

#: What the first bytes are: ``("need", None)`` more bytes wanted; ``("not_tls", None)``;
#: ``("sni", name)``; ``("no_sni", None)``; ``("malformed", None)``.
Hello = tuple[Literal["need", "not_tls", "sni", "no_sni", "malformed"], str | None]

#: A ClientHello is one handshake message in the first record(s); a record is at most
#: 16 KiB plus its header. More than this without a whole hello is refused.
MAX_HELLO = 16384 + 5


def client_hello(data: bytes) -> Hello:
    """Classify the first bytes of a connection (see `Hello`)."""
    if not data:
        return ("need", None)
    if data[0] != 0x16:
        return ("not_tls", None)
    if len(data) < 5:
        return ("need", None)
    if data[1] != 0x03:
        return ("not_tls", None)
    length = int.from_bytes(data[3:5], "big")
    if len(data) < 5 + length:
        return ("need", None) if length + 5 <= MAX_HELLO else ("malformed", None)
    body = data[5 : 5 + length]
    try:
        return _parse_hello(body)
    except (IndexError, ValueError):
        return ("malformed", None)


def _parse_hello(body: bytes) -> Hello:
    if body[0] != 0x01:  # handshake type ClientHello
        return ("malformed", None)
    hs_len = int.from_bytes(body[1:4], "big")
    if hs_len + 4 > len(body):
        # A hello split over several records: rare, and not looked into: refused.
        return ("malformed", None)
    p = 4 + 2 + 32  # version, random
    p += 1 + body[p]  # session id
    p += 2 + int.from_bytes(body[p : p + 2], "big")  # cipher suites
    p += 1 + body[p]  # compression methods
    if p >= 4 + hs_len:
        return ("no_sni", None)
    end = p + 2 + int.from_bytes(body[p : p + 2], "big")
    p += 2
    while p + 4 <= end:
        kind = int.from_bytes(body[p : p + 2], "big")
        size = int.from_bytes(body[p + 2 : p + 4], "big")
        ext = body[p + 4 : p + 4 + size]
        if len(ext) != size:
            raise ValueError("truncated extension")
        if kind == 0:  # server_name
            q = 2
            names: list[str] = []
            while q + 3 <= len(ext):
                name_type = ext[q]
                n = int.from_bytes(ext[q + 1 : q + 3], "big")
                name = ext[q + 3 : q + 3 + n]
                if name_type == 0:
                    names.append(name.decode("ascii"))
                q += 3 + n
            if len(names) != 1:
                return ("malformed", None)
            return ("sni", names[0])
        p += 4 + size
    return ("no_sni", None)
