"""Final arguments, when clauses, provider authority, glob semantics and argument vetting."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from metnos_exec.capabilities import (
    PROVIDER_SKILLS,
    effective_capabilities,
    final_args,
    match_host,
    match_path,
    resolve_path,
    vet_arguments,
)
from metnos_exec.errors import BadArguments, CapabilityDenied
from metnos_exec.manifest import Manifest


def mk(args: dict[str, Any] | None = None, caps: list[dict[str, Any]] | None = None) -> Manifest:
    return msgspec.convert(
        {
            "name": "t",
            "version": "1",
            "runtime": "python",
            "entry": "main.py",
            "args": args or {},
            "capabilities": caps or [],
        },
        Manifest,
    )


# --- final_args -----------------------------------------------------------------------


def test_final_args_applies_defaults_and_keeps_given() -> None:
    m = mk({"a": {"type": "string", "default": "x"}, "b": {"type": "integer"}})
    assert final_args(m, {}) == {"a": "x"}
    assert final_args(m, {"a": "y", "b": 3}) == {"a": "y", "b": 3}


def test_final_args_null_counts_as_absent() -> None:
    m = mk({"a": {"type": "string", "default": "x"}})
    assert final_args(m, {"a": None}) == {"a": "x"}


@pytest.mark.parametrize(
    ("spec", "value"),
    [
        ({"type": "string"}, 1),
        ({"type": "integer"}, True),
        ({"type": "integer"}, 1.5),
        ({"type": "number"}, False),
        ({"type": "number"}, "1"),
        ({"type": "boolean"}, 1),
        ({"type": "array"}, "x"),
        ({"type": "object"}, []),
    ],
)
def test_final_args_rejects_wrong_types(spec: dict[str, Any], value: Any) -> None:
    m = mk({"a": spec})
    with pytest.raises(BadArguments, match="argument `a` must be of type") as ei:
        final_args(m, {"a": value})
    assert ei.value.code == "E_BAD_ARGS"


def test_final_args_accepts_number_int_and_float() -> None:
    m = mk({"a": {"type": "number"}})
    assert final_args(m, {"a": 1}) == {"a": 1}
    assert final_args(m, {"a": 1.5}) == {"a": 1.5}


def test_final_args_rejects_unknown_missing_and_off_enum() -> None:
    m = mk({"a": {"type": "string", "required": True}, "m": {"enum": ["x", "y"]}})
    with pytest.raises(BadArguments, match=r"unknown argument.*zz"):
        final_args(m, {"a": "1", "zz": 2})
    with pytest.raises(BadArguments, match="`a` is required"):
        final_args(m, {})
    with pytest.raises(BadArguments, match="not one of"):
        final_args(m, {"a": "1", "m": "z"})
    with pytest.raises(BadArguments, match="must be an object"):
        final_args(m, ["a"])  # type: ignore[arg-type]


def test_final_args_enum_keeps_bool_apart_from_int() -> None:
    m = mk({"n": {"type": "integer", "enum": [1, 2]}})
    assert final_args(m, {"n": 1}) == {"n": 1}
    with pytest.raises(BadArguments):
        final_args(m, {"n": True})


# --- when clauses ---------------------------------------------------------------------

SYNC = {"name": "network:https", "hints": ["notes.example.com"]}


def _active_names(m: Manifest, args: dict[str, Any]) -> list[str]:
    eff = effective_capabilities(m, final_args(m, args))
    return [c.name for c in eff.active]


def test_when_matches_final_value_and_schema_default() -> None:
    args = {"mode": {"enum": ["append", "sync"], "default": "append"}}
    m = mk(args, [{**SYNC, "when": {"arg": "mode", "values": ["sync"]}}])
    assert _active_names(m, {}) == []
    assert _active_names(m, {"mode": "sync"}) == ["network:https"]
    eff = effective_capabilities(m, final_args(m, {}))
    assert "mode = 'append' is not one of ['sync']" in eff.inactive[0].reason
    # The default counts too: flip it and the capability is active without arguments.
    m2 = mk(
        {"mode": {"enum": ["append", "sync"], "default": "sync"}},
        [{**SYNC, "when": {"arg": "mode", "values": ["sync"]}}],
    )
    assert _active_names(m2, {}) == ["network:https"]


def test_when_booleans_compare_as_true_false_strings() -> None:
    m = mk(
        {"push": {"type": "boolean", "default": False}},
        [{**SYNC, "when": {"arg": "push", "values": ["true"]}}],
    )
    assert _active_names(m, {}) == []
    assert _active_names(m, {"push": True}) == ["network:https"]
    # "True" (Python's spelling) is not "true": documented, and it must not match.
    m2 = mk({"push": {"type": "boolean"}}, [{**SYNC, "when": {"arg": "push", "values": ["True"]}}])
    assert _active_names(m2, {"push": True}) == []


def test_when_integers_compare_as_decimal_strings() -> None:
    m = mk({"n": {"type": "integer"}}, [{**SYNC, "when": {"arg": "n", "values": ["2"]}}])
    assert _active_names(m, {"n": 2}) == ["network:https"]
    assert _active_names(m, {"n": 3}) == []


@pytest.mark.parametrize(
    ("when", "reason"),
    [
        ("mode == sync", "expected {arg, values}"),
        ({"arg": "mode"}, "keys must be exactly arg, values"),
        ({"arg": "mode", "values": ["sync"], "not": 1}, "keys must be exactly"),
        ({"arg": "nope", "values": ["sync"]}, "'nope' is not a declared argument"),
        ({"arg": "mode", "values": "sync"}, "non-empty list of strings"),
        ({"arg": "mode", "values": []}, "non-empty list of strings"),
        ({"arg": "mode", "values": [1]}, "non-empty list of strings"),
        ({"arg": "mode", "values": ["bogus"]}, "not in the enum"),
        ({"arg": "ratio", "values": ["1.5"]}, "type number"),
        ({"arg": "opt", "values": ["x"]}, "absent and has no default"),
        ([], "expected {arg, values}, got list"),
        (5, "expected {arg, values}, got int"),
        ({"arg": 1, "values": ["sync"]}, "arg 1 is not a declared argument"),
        ({"arg": "mode", "values": [["sync"]]}, "non-empty list of strings"),
        ({"arg": "mode", "values": {"sync": 1}}, "non-empty list of strings"),
    ],
)
def test_malformed_or_unmatched_when_is_inactive_never_raises(when: Any, reason: str) -> None:
    m = mk(
        {
            "mode": {"enum": ["append", "sync"], "default": "sync"},
            "ratio": {"type": "number", "default": 1.5},
            "opt": {"type": "string"},
        },
        [{**SYNC, "when": when}],
    )
    eff = effective_capabilities(m, final_args(m, {}))
    assert eff.active == ()
    assert len(eff.inactive) == 1
    assert eff.inactive[0].name == "network:https"
    assert reason in eff.inactive[0].reason
    assert not eff.network


def test_unknown_kinds_kept_but_grant_nothing() -> None:
    m = mk(caps=[{"name": "code:exec"}, {"name": "fs:exec", "hints": ["/tmp/**"]}])
    eff = effective_capabilities(m, {})
    assert [c.name for c in eff.active] == ["code:exec", "fs:exec"]
    assert eff.unknown_kinds == ("code:exec", "fs:exec")
    assert not eff.network and not eff.fs_write
    # fs:exec hints admit no path argument.
    with pytest.raises(CapabilityDenied):
        vet_arguments(m, {"p": "/tmp/x"}, eff, home="/root")


# --- provider authority ---------------------------------------------------------------


def test_provider_vocabulary_is_fixed() -> None:
    assert {"google_mail", "google_calendar", "microsoft_outlook", "github"} == PROVIDER_SKILLS


def test_valid_provider_binding_opens_network_and_pins() -> None:
    m = mk(caps=[{"name": "provider:access", "hints": ["google_mail"]}])
    eff = effective_capabilities(m, {})
    assert eff.provider_bindings == ("google_mail",)
    assert eff.network and eff.server_pinned
    assert eff.inactive == ()


@pytest.mark.parametrize(
    ("cap", "reason"),
    [
        ({"name": "provider:access", "hints": ["dropbox"]}, "'dropbox' is not in PROVIDER_SKILLS"),
        ({"name": "provider:access"}, "names no provider skill"),
        ({"name": "provider:admin", "hints": ["github"]}, "only provider:access"),
    ],
)
def test_invalid_provider_claims_grant_nothing(cap: dict[str, Any], reason: str) -> None:
    eff = effective_capabilities(mk(caps=[cap]), {})
    assert eff.provider_bindings == ()
    assert not eff.network and not eff.server_pinned
    assert reason in eff.inactive[0].reason


def test_mixed_provider_hints_bind_only_valid_skills() -> None:
    m = mk(caps=[{"name": "provider:access", "hints": ["github", "evil", "github"]}])
    eff = effective_capabilities(m, {})
    assert eff.provider_bindings == ("github",)
    assert [i.reason for i in eff.inactive] == [
        "skill 'evil' is not in PROVIDER_SKILLS; grants nothing"
    ]


def test_provider_binding_respects_when() -> None:
    m = mk(
        {"acct": {"enum": ["mail", "none"], "default": "none"}},
        [
            {
                "name": "provider:access",
                "hints": ["google_mail"],
                "when": {"arg": "acct", "values": ["mail"]},
            }
        ],
    )
    assert effective_capabilities(m, final_args(m, {})).provider_bindings == ()
    assert effective_capabilities(m, final_args(m, {"acct": "mail"})).provider_bindings == (
        "google_mail",
    )


def test_provider_binding_admits_no_url() -> None:
    m = mk({"u": {"format": "url"}}, [{"name": "provider:access", "hints": ["github"]}])
    eff = effective_capabilities(m, {})
    with pytest.raises(CapabilityDenied, match="no active network:https hint"):
        vet_arguments(m, {"u": "https://api.github.com/"}, eff, home="/root")


# --- glob semantics -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "path", "ok"),
    [
        ("/h/notes/**", "/h/notes", True),
        ("/h/notes/**", "/h/notes/a.md", True),
        ("/h/notes/**", "/h/notes/x/y/z.md", True),
        ("/h/notes/**", "/h/notesx/a.md", False),
        ("/h/notes/**", "/h/other", False),
        ("/h/notes/*", "/h/notes/a.md", True),
        ("/h/notes/*", "/h/notes/x/a.md", False),  # `*` never crosses a slash
        ("/h/notes/*", "/h/notes", False),
        ("/h/notes/*.md", "/h/notes/a.md", True),
        ("/h/notes/*.md", "/h/notes/a.txt", False),
        ("/h/notes/**/*.md", "/h/notes/a.md", True),
        ("/h/notes/**/*.md", "/h/notes/d/e/a.md", True),
        ("/h/notes/**/*.md", "/h/notes/d/e/a.txt", False),
        ("/h/**/**/x", "/h/a/b/x", True),
        ("/h/?.md", "/h/a.md", True),
        ("/h/[ab].md", "/h/c.md", False),
        ("/h/Pictures", "/h/Pictures", True),
        ("/h/Pictures", "/h/Pictures/a.jpg", False),  # no glob: exactly that path
        ("/tmp/*", "/tmp/x", True),
    ],
)
def test_match_path(pattern: str, path: str, ok: bool) -> None:
    assert match_path(pattern, path) is ok


def test_match_path_many_stars_stays_fast() -> None:
    # Collapsed `**` runs keep this linear-ish instead of exponential.
    assert not match_path("/a/" + "**/" * 30 + "z", "/a/" + "b/" * 30 + "c")


@pytest.mark.parametrize(
    ("hint", "host", "port", "default", "ok"),
    [
        ("notes.example.com", "notes.example.com", None, 443, True),
        ("notes.example.com", "NOTES.example.com.", None, 443, True),
        ("notes.example.com", "evil.com", None, 443, False),
        ("notes.example.com", "notes.example.com.evil.com", None, 443, False),
        ("*.example.com", "a.example.com", None, 443, True),
        ("*.example.com", "a.b.example.com", None, 443, True),
        ("*.example.com", "example.com", None, 443, False),
        ("*.example.com", "badexample.com", None, 443, False),
        ("*", "anything.org", 443, 443, True),
        ("127.0.0.1:8080", "127.0.0.1", 8080, 80, True),
        ("127.0.0.1:8080", "127.0.0.1", 8081, 80, False),
        ("[::1]:80", "::1", 80, None, True),
        # The wall's port rule: a hint without a port is its mode's default port only
        # (it used to admit any port here while the wall refused all but 443/80).
        ("api.example.com", "api.example.com", 443, 443, True),
        ("api.example.com", "api.example.com", 8443, 443, False),
        ("127.0.0.1", "127.0.0.1", 9999, 80, False),
        ("*", "anything.org", 22, 443, False),
        # A mode without a default port (network:tcp): a port-less hint grants the wall no
        # connection, so no value naming a port passes; a bare host still does.
        ("[::1]", "::1", 5, None, False),
        ("db.example.com", "db.example.com", None, None, True),
    ],
)
def test_match_host(hint: str, host: str, port: int | None, default: int | None, ok: bool) -> None:
    assert match_host(hint, host, port, default) is ok


# --- path vetting ---------------------------------------------------------------------


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    (h / "notes" / "sub").mkdir(parents=True)
    (h / "notes" / "a.md").write_text("a")
    (h / "secret").mkdir()
    (h / "secret" / "key").write_text("k")
    return h


NOTES_READ = [{"name": "fs:read", "hints": ["~/notes/**"]}]


def _vet(m: Manifest, args: dict[str, Any], home: Path) -> dict[str, Any]:
    fa = final_args(m, args)
    return vet_arguments(m, fa, effective_capabilities(m, fa), home=str(home)).args


def test_path_under_hint_is_rewritten_to_resolved_absolute(home: Path) -> None:
    m = mk({"path": {"format": "path"}}, NOTES_READ)
    assert _vet(m, {"path": "~/notes/a.md"}, home) == {"path": str(home / "notes" / "a.md")}
    assert _vet(m, {"path": f"file://{home}/notes/a.md"}, home)["path"] == str(
        home / "notes" / "a.md"
    )


def test_not_yet_existing_file_is_allowed_when_parent_matches(home: Path) -> None:
    m = mk({"path": {"format": "path"}}, NOTES_READ)
    assert _vet(m, {"path": "~/notes/sub/new/deeper.md"}, home)["path"] == str(
        home / "notes" / "sub" / "new" / "deeper.md"
    )


@pytest.mark.parametrize(
    "value",
    [
        "~/secret/key",
        "~/notes/../secret/key",
        "~/notes/sub/../../secret/key",
        "~/notes/nonexistent/../../secret/key",
        "/etc/passwd",
        "notes/a.md",  # relative: refused, not guessed
        "~root/notes/a.md",
        "file://otherhost/etc/passwd",
        "~/notes\0/a.md",
        "file:///{home}/notes/%2e%2e/secret/key",  # percent-encoded `..`
    ],
)
def test_paths_outside_hints_are_denied(home: Path, value: str) -> None:
    value = value.replace("{home}", str(home).lstrip("/"))
    m = mk({"path": {"format": "path"}}, NOTES_READ)
    with pytest.raises(CapabilityDenied) as ei:
        _vet(m, {"path": value}, home)
    msg = ei.value.message
    assert "argument `path`" in msg and "~/notes/**" in msg
    assert ei.value.code == "E_CAPABILITY_DENIED"


def test_symlink_escape_is_denied(home: Path) -> None:
    (home / "notes" / "link").symlink_to(home / "secret")
    (home / "notes" / "key.md").symlink_to(home / "secret" / "key")
    m = mk({"path": {"format": "path"}}, NOTES_READ)
    for value in ("~/notes/link/key", "~/notes/key.md", "~/notes/link/new-file"):
        with pytest.raises(CapabilityDenied, match="resolved"):
            _vet(m, {"path": value}, home)


def test_symlink_inside_hint_is_fine(home: Path) -> None:
    (home / "notes" / "alias").symlink_to(home / "notes" / "sub")
    m = mk({"path": {"format": "path"}}, NOTES_READ)
    assert _vet(m, {"path": "~/notes/alias/x.md"}, home)["path"] == str(
        home / "notes" / "sub" / "x.md"
    )


def test_symlinked_hint_root_is_refused_like_the_mount_would_be(tmp_path: Path) -> None:
    # The hint names ~/notes; a link there would have its target mounted (issue 8): vetting
    # refuses it too, with the same code, whatever the argument.
    from metnos_exec.errors import SymlinkedFolder

    real = tmp_path / "data" / "notes"
    real.mkdir(parents=True)
    h = tmp_path / "h"
    h.mkdir()
    (h / "notes").symlink_to(real)
    m = mk({"path": {"format": "path"}}, NOTES_READ)
    for value in ("~/notes/x.md", str(real / "x.md")):
        with pytest.raises(SymlinkedFolder, match="notes"):
            _vet(m, {"path": value}, h)


def test_inactive_fs_capability_admits_nothing(home: Path) -> None:
    m = mk(
        {"path": {"format": "path"}, "mode": {"enum": ["a", "b"], "default": "a"}},
        [{"name": "fs:read", "hints": ["~/notes/**"], "when": {"arg": "mode", "values": ["b"]}}],
    )
    with pytest.raises(CapabilityDenied, match="no active fs"):
        _vet(m, {"path": "~/notes/a.md"}, home)
    assert _vet(m, {"path": "~/notes/a.md", "mode": "b"}, home)["path"].endswith("a.md")


def test_write_hint_admits_paths_too(home: Path) -> None:
    m = mk({"path": {"format": "path"}}, [{"name": "fs:write", "hints": ["~/notes/*.md"]}])
    assert _vet(m, {"path": "~/notes/b.md"}, home)["path"] == str(home / "notes" / "b.md")
    with pytest.raises(CapabilityDenied):
        _vet(m, {"path": "~/notes/sub/b.md"}, home)


def test_path_arrays_are_vetted_element_by_element(home: Path) -> None:
    m = mk({"paths": {"type": "array", "format": "path"}}, NOTES_READ)
    assert _vet(m, {"paths": ["~/notes/a.md"]}, home) == {"paths": [str(home / "notes/a.md")]}
    with pytest.raises(CapabilityDenied, match=r"`paths\[1\]`"):
        _vet(m, {"paths": ["~/notes/a.md", "~/secret/key"]}, home)


def test_undeclared_path_like_strings_are_vetted_but_not_rewritten(home: Path) -> None:
    m = mk({"note": {}, "opts": {"type": "object"}}, NOTES_READ)
    assert _vet(m, {"note": "~/notes/a.md"}, home) == {"note": "~/notes/a.md"}
    assert _vet(m, {"note": "just words / with a slash"}, home)["note"].startswith("just")
    with pytest.raises(CapabilityDenied, match="`note`"):
        _vet(m, {"note": "/etc/shadow"}, home)
    with pytest.raises(CapabilityDenied, match=r"`opts\.deep\[0\]`"):
        _vet(m, {"opts": {"deep": ["file:///etc/passwd"]}}, home)
    with pytest.raises(CapabilityDenied, match="`note`"):
        _vet(m, {"note": "https://evil.example.org/x"}, home)


def test_text_format_is_never_vetted(home: Path) -> None:
    m = mk({"note": {"format": "text"}}, NOTES_READ)
    assert _vet(m, {"note": "/etc/shadow is a file"}, home) == {"note": "/etc/shadow is a file"}


def test_relative_resolve_path_refused() -> None:
    with pytest.raises(ValueError, match="absolute"):
        resolve_path("a/b", "/root")
    assert resolve_path("~", "/") == "/"
    assert resolve_path("/a/./b/../c", "/x") == os.path.realpath("/a/c")


# --- network vetting ------------------------------------------------------------------

NET = [
    {"name": "network:https", "hints": ["notes.example.com", "*.api.example.com"]},
    {"name": "network:http", "hints": ["127.0.0.1", "127.0.0.1:8000"]},
]


@pytest.mark.parametrize(
    "url",
    [
        "https://notes.example.com/x?y=1",
        "https://v1.api.example.com/",
        "https://NOTES.example.com:443/",
        "http://127.0.0.1/hello",
        "http://127.0.0.1:8000/hello",
    ],
)
def test_urls_under_hints_pass(url: str) -> None:
    m = mk({"url": {"format": "url"}}, NET)
    fa = final_args(m, {"url": url})
    vetted = vet_arguments(m, fa, effective_capabilities(m, fa), home="/root")
    assert vetted.args == {"url": url}
    assert vetted.checked[0].kind == "url"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://notes.example.com/", "scheme http"),  # https hint does not admit http
        ("https://127.0.0.1/", "scheme https"),  # nor the other way round
        ("https://evil.com/", "host evil.com"),
        ("https://notes.example.com.evil.com/", "outside"),
        ("https://notes.example.com@evil.com/", "credentials"),
        ("https://user:pw@notes.example.com/", "credentials"),
        ("https://evil.com\\@notes.example.com/", "backslash"),
        ("https://notes.example.com/ x", "whitespace"),
        ("ftp://notes.example.com/", "scheme ftp"),
        ("https:///nohost", "names no host"),
        ("https://[::1/", "not a valid URL"),
        ("notes.example.com", "names no host"),
    ],
)
def test_urls_outside_hints_are_denied(url: str, why: str) -> None:
    m = mk({"url": {"format": "url"}}, NET)
    fa = final_args(m, {"url": url})
    with pytest.raises(CapabilityDenied, match="argument `url`") as ei:
        vet_arguments(m, fa, effective_capabilities(m, fa), home="/root")
    assert why in ei.value.message


def test_url_port_hints_use_the_scheme_default() -> None:
    m = mk({"url": {"format": "url"}}, [{"name": "network:https", "hints": ["a.example:443"]}])
    for url, ok in [
        ("https://a.example/", True),
        ("https://a.example:443/", True),
        ("https://a.example:8443/", False),
    ]:
        fa = final_args(m, {"url": url})
        eff = effective_capabilities(m, fa)
        if ok:
            vet_arguments(m, fa, eff, home="/root")
        else:
            with pytest.raises(CapabilityDenied):
                vet_arguments(m, fa, eff, home="/root")


@pytest.mark.parametrize(
    "url", ["https://notes.example.com:8443/", "http://127.0.0.1:5000/", "https://127.0.0.1/"]
)
def test_urls_on_ports_the_wall_refuses_are_denied(url: str) -> None:
    # The network wall's port rule: a hint without a port is its mode's default port
    # (https 443, http 80). Vetting once let these through, and the wall refused them.
    m = mk({"url": {"format": "url"}}, NET)
    fa = final_args(m, {"url": url})
    with pytest.raises(CapabilityDenied, match="outside every active network hint"):
        vet_arguments(m, fa, effective_capabilities(m, fa), home="/root")


def test_host_arguments() -> None:
    m = mk({"host": {"format": "host"}}, NET)
    for ok in ("notes.example.com", "127.0.0.1:8000", "127.0.0.1:80", "a.api.example.com"):
        fa = final_args(m, {"host": ok})
        vet_arguments(m, fa, effective_capabilities(m, fa), home="/root")
    for bad in ("evil.com", "notes.example.com/../", "", "a b", "127.0.0.1:5000",
                "notes.example.com:8443"):  # fmt: skip
        fa = final_args(m, {"host": bad})
        with pytest.raises(CapabilityDenied, match="argument `host`"):
            vet_arguments(m, fa, effective_capabilities(m, fa), home="/root")


def test_url_with_inactive_network_capability_is_denied() -> None:
    m = mk(
        {"url": {"format": "url"}, "mode": {"enum": ["off", "on"], "default": "off"}},
        [{**NET[0], "when": {"arg": "mode", "values": ["on"]}}],
    )
    fa = final_args(m, {"url": "https://notes.example.com/"})
    with pytest.raises(CapabilityDenied, match="no active network:https hint"):
        vet_arguments(m, fa, effective_capabilities(m, fa), home="/root")


def test_relative_hints_admit_nothing_and_are_named(home: Path) -> None:
    m = mk({"path": {"format": "path"}}, [{"name": "fs:read", "hints": ["notes/**"]}])
    with pytest.raises(CapabilityDenied, match=r"ignored, not absolute: notes/\*\*"):
        _vet(m, {"path": "~/notes/a.md"}, home)


# --- relative paths and the undeclared-string heuristic -------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "../../../../../../../tmp/pwned.txt",  # the review's repro (direct arm, cwd = folder)
        "./pwned.txt",
        "..",
        ".",
        "notes/../../pwned.txt",
        "notes/..",
    ],
)
def test_undeclared_relative_paths_are_refused(home: Path, value: str) -> None:
    m = mk({"path": {}}, [{"name": "fs:write", "hints": ["~/notes/**"]}])
    with pytest.raises(CapabilityDenied, match="argument `path`") as ei:
        _vet(m, {"path": value}, home)
    assert "relative path" in ei.value.message
    assert "pass an absolute or ~/ path" in ei.value.message


def test_relative_paths_inside_structures_are_refused(home: Path) -> None:
    m = mk({"opts": {"type": "object"}}, NOTES_READ)
    with pytest.raises(CapabilityDenied, match=r"`opts\.files\[0\]`.*relative path"):
        _vet(m, {"opts": {"files": ["../x"]}}, home)


@pytest.mark.parametrize("value", ["notes/a.md", "../secret/key", "./a.md", "a.md"])
def test_declared_relative_path_is_refused_with_the_fix(home: Path, value: str) -> None:
    m = mk({"path": {"format": "path"}}, NOTES_READ)
    with pytest.raises(CapabilityDenied, match="pass an absolute or ~/ path"):
        _vet(m, {"path": value}, home)


@pytest.mark.parametrize(
    "value",
    ["buy milk", "and/or", "v1.2.3", "...", "ok..", "a..b/c", "notes/today.md"],
)
def test_plain_text_is_not_taken_for_a_relative_path(home: Path, value: str) -> None:
    # The heuristic looks for dot segments only; ordinary sentences must pass unvetted.
    m = mk({"note": {}}, [])
    assert _vet(m, {"note": value}, home) == {"note": value}


@pytest.mark.parametrize("value", ["https://example.com", "~/todo", "/etc/passwd", "../x"])
def test_text_format_accepts_what_bare_strings_refuse(home: Path, value: str) -> None:
    m = mk({"text": {"format": "text"}}, [])
    assert _vet(m, {"text": value}, home) == {"text": value}
    bare = mk({"text": {}}, [])
    with pytest.raises(CapabilityDenied):
        _vet(bare, {"text": value}, home)


# --- hint folders that do not exist ---------------------------------------------------


def test_missing_hint_folder_is_named_with_the_fix(tmp_path: Path) -> None:
    from metnos_exec.capabilities import require_hint_folders
    from metnos_exec.errors import MissingFolder

    h = tmp_path / "newcomer"
    h.mkdir()
    m = mk({"path": {"format": "path"}}, [{"name": "fs:write", "hints": ["~/notes/**"]}])
    fa = final_args(m, {"path": "~/notes/today.md"})
    vetted = vet_arguments(m, fa, effective_capabilities(m, fa), home=str(h))
    with pytest.raises(MissingFolder) as ei:
        require_hint_folders("t", vetted.checked, str(h))
    assert ei.value.code == "E_MISSING_FOLDER"
    assert ei.value.message == (
        f"t: argument `path` = '~/notes/today.md' is under hint '~/notes/**', "
        f"but {h}/notes does not exist, so it cannot be mounted; create it first"
    )
    (h / "notes").mkdir()
    require_hint_folders("t", vetted.checked, str(h))  # now it can be mounted
