"""Text a `Result` carries: the stderr cap and its decoder (re-exported by
`metnos_exec.messages`)."""

from __future__ import annotations

from typing import Final

__all__ = ("STDERR_CAP_BYTES", "cap_text")

#: stderr kept in a `Result` (bytes of UTF-8); the rest is dropped and flagged.
STDERR_CAP_BYTES: Final = 64 * 1024


def cap_text(data: bytes, cap: int = STDERR_CAP_BYTES) -> tuple[str, bool]:
    """Decode `data` as UTF-8 (replacing bad bytes), keeping at most `cap` bytes.

    Returns:
        The text and whether anything was cut.
    """
    cut = len(data) > cap
    return data[:cap].decode("utf-8", errors="replace"), cut
