"""Untrusted text made safe to print on a terminal.

A job's stderr, its output, a guest's trap message, an error that quotes what a job sent:
printed raw, their control characters drive the operator's terminal (ESC sequences retitle
the window, clear the screen or rewrite lines already shown, ``\\r`` overprints a line, BEL
rings, C1 controls act like ESC on some terminals, bidi overrides reorder what is read).
`visible` spells every such character out (``\\x1b``, ``\\r``, ``\\u202e``) so what the
operator sees is what was sent. Machine outputs (``--json``) stay exact and never pass
through here.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ("visible",)

#: Anything but tab, newline and printable ASCII; each match is then judged by its category.
_CANDIDATES = re.compile(r"[^\t\n\x20-\x7e]")
#: Unicode categories that are never shown as themselves: controls (C0, DEL, C1), format
#: characters (bidi overrides and isolates, zero-width joiners, the BOM...), line and
#: paragraph separators, lone surrogates (undecodable bytes).
_HIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _spell(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _replace(match: re.Match[str]) -> str:
    char = match.group()
    return _spell(char) if unicodedata.category(char) in _HIDDEN else char


def visible(text: str, *, newlines: bool = False) -> str:
    """`text` with every control, format and separator character spelled out.

    Args:
        text: untrusted text.
        newlines: keep ``\\n`` as a line break (for multi-line blocks such as stderr);
            otherwise it is spelled ``\\n`` too, so a one-line field cannot forge more
            lines of the report it sits in. Tabs are kept either way.

    Returns:
        Text that moves the cursor only by printing characters (and line breaks when
        `newlines`).
    """
    out = _CANDIDATES.sub(_replace, text)
    return out if newlines else out.replace("\n", "\\n")
