"""Run inside a real bwrap job behind the network wall: try every way out, print JSON.

``python -c <this file's text> '<json config>'``; each attempt's outcome is a short
string the test asserts on (``ok:...`` when it got through, anything else when not).
Standard library only (it runs under the guest's isolated interpreter).
"""

import json
import os
import socket
import ssl
import struct
import subprocess
import sys
import urllib.request

cfg = json.loads(sys.argv[1])
PORT, SECRET = cfg["port"], cfg["secret"]
out = {}


def attempt(name):
    def wrap(fn):
        try:
            out[name] = "ok:" + str(fn())
        except Exception as exc:  # every failure is an answer
            out[name] = f"no:{type(exc).__name__}:{exc}"[:300]
        return fn

    return wrap


def talk(sock, data=b"GET / HTTP/1.0\r\n\r\n"):
    with sock:
        sock.settimeout(5)
        sock.sendall(data)
        got = sock.recv(200)
        if not got:
            raise ConnectionError("closed without an answer")
        return got.decode("latin-1").split("\r\n")[0]


def connect_via_proxy(host, port, inner=None):
    s = socket.create_connection(("127.0.0.1", int(os.environ["HTTP_PROXY"].rsplit(":", 1)[1])), 5)
    s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    head = s.recv(4096).decode("latin-1")
    if not head.startswith("HTTP/1.1 200"):
        s.close()
        raise PermissionError(head.split("\r\n")[0] + " | " + head.split("\r\n\r\n", 1)[-1][:120])
    return s


def socks(host, port):
    s = socket.create_connection(("127.0.0.1", int(os.environ["ALL_PROXY"].rsplit(":", 1)[1])), 5)
    s.sendall(b"\x05\x01\x00")
    assert s.recv(2) == b"\x05\x00"
    name = host.encode()
    s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", port))
    reply = s.recv(10)
    if reply[1] != 0:
        s.close()
        raise PermissionError(f"socks reply {reply[1]}")
    return s


@attempt("literal_direct")
def _():
    return talk(socket.create_connection(("127.0.0.1", PORT), 5))


@attempt("literal_urllib")
def _():
    return urllib.request.urlopen(f"http://127.0.0.1:{PORT}/", timeout=5).status


@attempt("secret_direct")
def _():
    return talk(socket.create_connection(("127.0.0.1", SECRET), 5))


@attempt("secret_urllib")
def _():
    return urllib.request.urlopen(f"http://127.0.0.1:{SECRET}/", timeout=5).status


@attempt("secret_connect")
def _():
    return talk(connect_via_proxy("127.0.0.1", SECRET))


@attempt("secret_socks")
def _():
    return talk(socks("127.0.0.1", SECRET))


@attempt("redis_direct")
def _():
    return talk(socket.create_connection(("127.0.0.1", 6379), 5), b"PING\r\n")


@attempt("redis_proxy")
def _():
    return talk(connect_via_proxy("127.0.0.1", 6379), b"PING\r\n")


@attempt("other_loopback_address")
def _():
    return talk(socket.create_connection(("127.0.0.2", PORT), 5))


@attempt("ipv6_loopback")
def _():
    return talk(socket.create_connection(("::1", PORT), 5))


@attempt("bash_dev_tcp")
def _():
    run = subprocess.run(
        ["/bin/bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{SECRET} && echo connected"],
        capture_output=True,
        timeout=10,
    )
    if run.returncode == 0:
        return run.stdout.decode().strip()
    raise ConnectionError(run.stderr.decode().strip()[-120:])


def tool(argv):
    run = subprocess.run(argv, capture_output=True, timeout=20)
    if run.returncode == 0:
        return run.stdout.decode(errors="replace").strip()[:80]
    raise ConnectionError(
        f"exit {run.returncode}: {run.stderr.decode(errors='replace').strip()[-160:]}"
    )


if os.path.exists("/usr/bin/curl"):

    @attempt("curl_literal")
    def _():
        return tool(["/usr/bin/curl", "-sS", "--max-time", "8", f"http://127.0.0.1:{PORT}/"])

    @attempt("curl_secret")
    def _():
        return tool(
            ["/usr/bin/curl", "-sS", "-f", "--max-time", "8", f"http://127.0.0.1:{SECRET}/"]
        )

    @attempt("curl_secret_noproxy")
    def _():
        return tool(
            [
                "/usr/bin/curl",
                "-sS",
                "--noproxy",
                "*",
                "--max-time",
                "8",
                f"http://127.0.0.1:{SECRET}/",
            ]
        )

    @attempt("curl_refusal_text")
    def _():
        run = subprocess.run(
            ["/usr/bin/curl", "-sS", "-i", "--max-time", "8", f"http://127.0.0.1:{SECRET}/"],
            capture_output=True,
            timeout=20,
        )
        return run.stdout.decode(errors="replace")[:600]


if os.path.exists("/usr/bin/wget"):

    @attempt("wget_secret")
    def _():
        return tool(
            ["/usr/bin/wget", "-q", "-O-", "-T", "8", "-t", "1", f"http://127.0.0.1:{SECRET}/"]
        )


@attempt("getent_allowed")
def _():
    return tool(["getent", "hosts", cfg["name"]])


@attempt("getent_refused")
def _():
    return tool(["getent", "hosts", "evil.example.org"])


@attempt("capture")
def _():
    address = socket.getaddrinfo(cfg["name"], cfg["name_port"], socket.AF_INET, socket.SOCK_STREAM)
    return (
        address[0][4][0] + " " + talk(socket.create_connection((cfg["name"], cfg["name_port"]), 5))
    )


@attempt("name_connect")
def _():
    return talk(connect_via_proxy(cfg["name"], cfg["name_port"]))


@attempt("name_socks")
def _():
    return talk(socks(cfg["name"], cfg["name_port"]))


@attempt("lookalike")
def _():
    return talk(connect_via_proxy(cfg["name"] + ".evil", cfg["name_port"]))


@attempt("relayed_connect")
def _():
    s = connect_via_proxy(cfg["name"], cfg["name_port"])
    return talk(s, f"CONNECT 127.0.0.1:{SECRET} HTTP/1.1\r\n\r\n".encode())


def hello(server_name):
    s = connect_via_proxy(cfg["name"], cfg["name_port"])
    ctx = ssl.create_default_context()
    try:
        with ctx.wrap_socket(s, server_hostname=server_name) as tls:
            return tls.version()
    except (ssl.SSLError, OSError) as exc:
        return f"handshake ended: {type(exc).__name__}"


@attempt("sni_right")
def _():
    return hello(cfg["name"])


@attempt("sni_wrong")
def _():
    return hello("other.example.org")


@attempt("udp_other_53")
def _():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(1)
    query = (
        b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
        + b"".join(bytes([len(p)]) + p.encode() for p in cfg["name"].split("."))
        + b"\x00\x00\x01\x00\x01"
    )
    s.sendto(query, ("127.0.0.2", 53))
    return s.recvfrom(512)[0][:4].hex()


for extra in cfg.get("names_refused", []):

    @attempt(f"refused_name:{extra}")
    def _(extra=extra):
        return talk(connect_via_proxy(extra, cfg["name_port"]))

    @attempt(f"refused_name_socks:{extra}")
    def _(extra=extra):
        return talk(socks(extra, cfg["name_port"]))


print(json.dumps(out))
