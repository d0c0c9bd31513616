"""Security defaults: the server listens on loopback unless told otherwise, the API key is compared
in constant time, nothing pickled crosses the process boundary, and the IPC sockets live in a
private 0700 directory."""
from __future__ import annotations

import ast
import asyncio
import enum
import os
import socket
import stat
import tempfile
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from reliability_helpers import API_KEY, MODEL, ipc_dir_of

import tokenloom
from tokenloom import messages
from tokenloom.config import EngineConfig
from tokenloom.entrypoints.cli import build_parser
from tokenloom.entrypoints.openai import api_server
from tokenloom.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, LogprobsLists
from tokenloom.sampling_params import SamplingParams

SRC = Path(tokenloom.__file__).parent
# Every module on either side of the IPC boundary that encodes, decodes or defines what crosses it.
IPC_MODULES = ["messages.py", "config.py", "sampling_params.py", "engine/core_client.py", "engine/async_client.py", "core/engine_core_proc.py"]
PICKLERS = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}


# ---- bind address ---------------------------------------------------------------------------------


def test_serve_binds_loopback_by_default(shared_server):
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    # The real listening socket: every listener on the server's port is 127.0.0.1 and is the server's.
    inodes = set()
    for fd in Path(f"/proc/{shared_server.proc.pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    listeners = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            address, port = local.split(":")
            if state == "0A" and int(port, 16) == shared_server.port:  # 0A: LISTEN
                listeners.append((table, address, inode))
    assert listeners, "the server's port has no listener"
    for table, address, inode in listeners:
        assert table == "/proc/net/tcp" and address == "0100007F", listeners  # 127.0.0.1, little-endian
        assert inode in inodes, listeners
    # Not reachable through another address of this machine (when it has one).
    other = _non_loopback_address()
    if other is not None:
        with pytest.raises(OSError), socket.create_connection((other, shared_server.port), timeout=2):
            pass


def _non_loopback_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 1))  # no packet is sent: this only picks a route
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


# ---- API key ----------------------------------------------------------------------------------------


def test_wrong_keys_of_equal_length_are_rejected(shared_server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    wrong = [API_KEY[:-1] + ("x" if API_KEY[-1] != "x" else "y"), "x" * len(API_KEY), API_KEY.upper()]
    for key in wrong:
        assert len(key) == len(API_KEY) and key != API_KEY
        r = httpx.post(shared_server.url("/v1/completions"), headers={"Authorization": f"Bearer {key}"}, json=body, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    for headers in ({}, {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"}, {"X-Api-Key": API_KEY}):
        assert httpx.post(shared_server.url("/v1/completions"), headers=headers, json=body, timeout=60).status_code == 401
    r = httpx.post(shared_server.url("/v1/completions"), headers={"Authorization": f"Bearer {API_KEY}"}, json=body, timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(shared_server, scheme):
    """RFC 9110: the authentication scheme is case-insensitive; the key itself is not."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    r = httpx.post(shared_server.url("/v1/completions"), headers={"Authorization": f"{scheme} {API_KEY}"}, json=body, timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(shared_server.url("/v1/completions"), headers={"Authorization": f"{scheme} {API_KEY.upper()}"}, json=body, timeout=120)
    assert r.status_code == 401, r.text


def test_api_key_is_compared_with_hmac_compare_digest(monkeypatch):
    """The middleware's only comparison of the key is hmac.compare_digest of the header's token
    (after a case-insensitive "Bearer" scheme)."""
    calls = []
    real = api_server.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api_server.hmac, "compare_digest", spy)
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    middleware = api_server.ApiKeyMiddleware(app, api_keys=["secret"])

    async def call(auth: bytes) -> None:
        scope = {"type": "http", "path": "/v1/completions", "headers": [(b"authorization", auth)] if auth else []}
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b""}

        await middleware(scope, receive, send)

    for auth in (b"Bearer secreT", b"Bearer secret", b"", b"Basic secret"):
        asyncio.run(call(auth))
    assert calls == [(b"secreT", b"secret"), (b"secret", b"secret"), (b"", b"secret"), (b"", b"secret")]
    assert reached == ["/v1/completions"]  # only the right key got through
    # With several keys (vLLM's --api-key K1 K2) each is compared, whichever matches.
    calls.clear()
    reached.clear()
    middleware = api_server.ApiKeyMiddleware(app, api_keys=["one", "two"])
    for auth in (b"Bearer two", b"Bearer three"):
        asyncio.run(call(auth))
    assert calls == [(b"two", b"one"), (b"two", b"two"), (b"three", b"one"), (b"three", b"two")]
    assert reached == ["/v1/completions"]
    source = ast.parse(Path(api_server.__file__).read_text())
    compares = [
        node for node in ast.walk(source)
        if isinstance(node, ast.Compare) and any(isinstance(n, ast.Attribute) and n.attr == "expected" for n in ast.walk(node))
    ]  # fmt: skip
    assert not compares, "the API key must not be compared with ==/!="


# ---- no pickle across the process boundary -----------------------------------------------------


@pytest.mark.parametrize("module", IPC_MODULES)
def test_ipc_modules_do_not_pickle(module):
    tree = ast.parse((SRC / module).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & PICKLERS, imported & PICKLERS
    # pyzmq's *_pyobj helpers pickle.
    calls = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized"} & calls


def test_wire_messages_are_structs_a_plain_decoder_reads():
    wire_types = [
        getattr(messages, name) for name in dir(messages)
        if isinstance(getattr(messages, name), type) and getattr(messages, name).__module__ == messages.__name__
        and not issubclass(getattr(messages, name), (enum.Enum, Exception))  # enums travel as values
    ]  # fmt: skip
    assert EngineCoreRequest in wire_types and EngineCoreOutputs in wire_types
    for t in wire_types + [SamplingParams, EngineConfig]:
        assert issubclass(t, msgspec.Struct), t
    request = EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(temperature=0.5, stop=["\n"], logit_bias={7: 1.5}, bad_words=["x"], seed=3),
        eos_token_id=2,
        arrival_time=1.0,
    )
    outputs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(
                "r1", [4, 5], LogprobsLists([[4, 9]], [[-0.1, -2.0]], [1]), finish_reason=FinishReason.LENGTH, error=None
            )
        ],
        engine_error="boom",
    )
    encoder = msgspec.msgpack.Encoder()  # what the client and the core use: no object fallback
    for message in (request, outputs, SamplingParams()):
        plain = msgspec.msgpack.decode(encoder.encode(message))  # untyped: builtins only, or it fails
        _assert_plain(plain)
        assert msgspec.msgpack.decode(encoder.encode(message), type=type(message)) == message

    class NotAMessage:
        pass

    with pytest.raises(TypeError):
        encoder.encode(NotAMessage())  # an arbitrary object cannot be sent at all


def _assert_plain(value) -> None:
    if isinstance(value, (list, tuple)):
        for v in value:
            _assert_plain(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _assert_plain(k)
            _assert_plain(v)
    else:
        assert value is None or type(value) in (bool, int, float, str, bytes), type(value)


# ---- IPC sockets in a private directory ---------------------------------------------------------


def test_ipc_sockets_live_in_a_private_directory(offline_llm, shared_server):
    client = offline_llm.llm_engine.engine_core
    tmpdir = Path(client._tmpdir)
    info = tmpdir.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    assert tmpdir.parent == Path(tempfile.gettempdir())
    for sock in (client.input_socket, client.output_socket):
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert endpoint.startswith(f"ipc://{tmpdir}/"), endpoint
        assert stat.S_ISSOCK(Path(endpoint.removeprefix("ipc://")).stat().st_mode)
    # The server's engine core too (seen from its command line).
    server_dir = ipc_dir_of(shared_server.core_pid)
    assert stat.S_IMODE(server_dir.stat().st_mode) == 0o700 and server_dir.stat().st_uid == os.getuid()
