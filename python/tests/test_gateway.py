"""The gateway, against a running `chorus serve`: its OpenAPI document under a schema-driven
fuzzer (schemathesis sends what the document allows and what it does not; every answer must
be no server error and match the document), and a WebSocket agent written in Python that a
Rust agent asks and that asks Rust agents in turn."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import _free_port, rust_binary

WAIT = 20.0

API_KEY = "k-fuzz-5e1d9c3b7a2f4e6d8c0b1a3e5f7d9b2c"


def _wait_for_port(port: int, deadline: float) -> None:
    import socket

    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens on {port}") from None
            time.sleep(0.05)


@contextlib.contextmanager
def gateway(server: Any, tmp_path: Path, identity: str, extra: str = "") -> Iterator[int]:
    """`chorus serve` with a gateway on a free port, one identity with API_KEY; yields the port."""
    port = _free_port()
    config = tmp_path / "chorus.toml"
    config.write_text(
        "[gateway]\n"
        f'listen = "127.0.0.1:{port}"\n'
        f"{extra}"
        f'[[gateway.identities]]\nid = "{identity}"\n'
        f'[[gateway.api_keys]]\nidentity = "{identity}"\n'
        f'sha256 = "{hashlib.sha256(API_KEY.encode()).hexdigest()}"\n'
    )
    serve = subprocess.Popen(
        [rust_binary("chorus"), "--server", server.url, "serve", "--config", str(config)],
        env={"CHORUS_SERVE__METRICS_ADDR": "127.0.0.1:0", "RUST_LOG": "warn", "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, time.monotonic() + 30)
        yield port
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=15)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()


def test_the_openapi_document_holds_under_a_schema_driven_fuzzer(server: Any, tmp_path: Path) -> None:
    schemathesis = Path(sys.executable).parent / "schemathesis"
    if not schemathesis.exists():
        pytest.fail("schemathesis is not installed: run scripts/install-python-sdk")
    short = "max_wait_ms = 200\nrequest_timeout_ms = 500\nhold_ms = 500\n"
    with gateway(server, tmp_path, "fuzzer", short) as port:
        run = subprocess.run(
            [
                str(schemathesis), "run", f"http://127.0.0.1:{port}/openapi.json",
                "-H", f"X-API-Key: {API_KEY}",
                # not_a_server_fault (schemathesis_hooks.py): not_a_server_error, but for a
                # timeout the caller chose; positive_data_acceptance: nothing the document
                # allows is refused as malformed (issue 33).
                "--checks", "not_a_server_fault,status_code_conformance,content_type_conformance,response_schema_conformance,positive_data_acceptance",
                "--max-examples", "40",
                "--request-timeout", "10",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "SCHEMATHESIS_HOOKS": str(Path(__file__).with_name("schemathesis_hooks.py"))},
        )
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        # It tested every operation, hundreds of cases: a fuzzer that tested nothing must not pass.
        operations = re.search(r"Selected: (\d+)/\1\s+Tested: \1\b", run.stdout)
        assert operations is not None and int(operations.group(1)) >= 11, run.stdout[-3000:]
        cases = re.search(r"(\d+) generated, \1 passed", run.stdout)
        assert cases is not None and int(cases.group(1)) >= 100, run.stdout[-3000:]


async def _frame(ws: Any, kind: str) -> dict[str, Any]:
    """The next frame of type ``kind`` (others are skipped), within WAIT seconds."""

    async def next_of_kind() -> dict[str, Any]:
        while True:
            frame = json.loads(await ws.recv())
            if frame["type"] == kind:
                return dict(frame)

    return await asyncio.wait_for(next_of_kind(), WAIT)


async def test_a_websocket_agent_answers_a_rust_agent_and_asks_one(server: Any, rust_peer: Any, tmp_path: Path) -> None:
    import websockets
    from websockets.exceptions import InvalidStatus

    rust_peer()
    with gateway(server, tmp_path, "py-ws") as port:
        url = f"ws://127.0.0.1:{port}/v1/ws"
        # Credentials are checked before the socket opens.
        with pytest.raises(InvalidStatus) as refused:
            async with websockets.connect(url, additional_headers={"X-API-Key": "wrong"}):
                pass
        assert refused.value.response.status_code == 401
        async with websockets.connect(url, additional_headers={"X-API-Key": API_KEY}) as ws:
            assert (await _frame(ws, "welcome"))["identity"] == "py-ws"
            # A Rust agent (the CLI) asks the WebSocket agent; it answers over the socket.
            cli = await asyncio.create_subprocess_exec(
                rust_binary("chorus"), "--server", server.url, "request", "--to", "py-ws", "--command", "approve",
                "--json", "--timeout", "10s", '{"amount": 3}',
                stdout=asyncio.subprocess.PIPE,
            )
            message = (await _frame(ws, "message"))["message"]
            assert (message["command"], message["payload"], message["reply_expected"]) == ("approve", {"amount": 3}, True)
            await ws.send(json.dumps({"type": "reply", "ref": "r1", "in_reply_to": message["id"], "payload": {"approved": True}}))
            assert (await _frame(ws, "ok"))["ref"] == "r1"
            out, _ = await asyncio.wait_for(cli.communicate(), WAIT)
            answer = json.loads(out)
            assert (answer["status"], answer["from"], answer["payload"]) == (5002, "py-ws", {"approved": True})
            # The WebSocket agent asks the Rust peer, which asks it back in turn: both answered.
            await ws.send(json.dumps({"type": "request", "ref": "q1", "to": "rust-peer", "command": "ask",
                                      "payload": {"to": "py-ws", "command": "colour", "payload": None}}))
            question = (await _frame(ws, "message"))["message"]
            assert (question["from"], question["command"]) == ("rust-peer", "colour")
            await ws.send(json.dumps({"type": "reply", "in_reply_to": question["id"], "payload": "teal"}))
            result = await _frame(ws, "ok")
            while result["ref"] != "q1":
                result = await _frame(ws, "ok")
            assert (result["result"]["payload"], result["result"]["from"]) == ("teal", "rust-peer")
            # Events it subscribes to reach it, from the Rust agent that published them.
            await ws.send(json.dumps({"type": "subscribe", "ref": "s1", "topic": "ws.>"}))
            assert (await _frame(ws, "ok"))["result"] == {"subscribed": "ws.>"}
            await ws.send(json.dumps({"type": "request", "to": "rust-peer", "command": "emit",
                                      "payload": {"topic": "ws.hello", "payload": {"n": 1}}}))
            event = await _frame(ws, "event")
            assert (event["topic"], event["from"], event["payload"]) == ("ws.hello", "rust-peer", {"n": 1})
            # Bad frames are answered with codes, and the connection stays.
            await ws.send("not json")
            assert (await _frame(ws, "error"))["status"] == 5006
            await ws.send(json.dumps({"type": "dance", "ref": "x"}))
            error = await _frame(ws, "error")
            assert (error["status"], error["ref"]) == (5018, "x")
