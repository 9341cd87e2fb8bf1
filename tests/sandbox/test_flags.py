"""Unit tests for the pure bwrap flag derivation (no bubblewrap needed)."""

from __future__ import annotations

import pytest

from metnos_exec.sandbox.flags import expand_hint, expand_hints

HOME = "/home/u"


@pytest.mark.parametrize(
    ("hint", "root"),
    [
        ("~/notes/**", "/home/u/notes"),
        ("/tmp/*", "/tmp"),
        ("~/Pictures", "/home/u/Pictures"),
        ("~", "/home/u"),
        ("~/", "/home/u"),
        ("/data/x/*.md", "/data/x"),
        ("/data/a?c/d", "/data"),
        ("/data/[ab]/d", "/data"),
        ("/data//x/./y/", "/data/x/y"),
        ("/data/x/../y/**", "/data/y"),
    ],
)
def test_expand_hint_cuts_at_first_glob_segment_and_expands_home(hint: str, root: str) -> None:
    assert expand_hint(hint, HOME) == root


@pytest.mark.parametrize("hint", ["", "notes/**", "~bob/notes", "/*", "/**", "*"])
def test_expand_hint_refuses_relative_other_users_and_root(hint: str) -> None:
    with pytest.raises(ValueError):
        expand_hint(hint, HOME)


def test_expand_hints_dedupes_keeping_first_order() -> None:
    got = expand_hints(["~/notes/**", "/tmp/*", "~/notes/*.md", "/tmp"], HOME)
    assert got == ("/home/u/notes", "/tmp")
