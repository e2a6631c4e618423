"""The gateway's MCP server, from the official Python MCP client (`mcp` from PyPI), against the
demo's agents (`chorus up --join`) on a real bus: it lists their tools, calls the calculator
(divide by zero is a tool error with 5018), runs the writer's streamed task with progress, and
cancels the researcher's task (the researcher says it stopped). Raw HTTP checks the transport's
answers to bad input: never a 500, never a hang."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from .conftest import ChorusProcess, NatsServer, _free_port, rust_binary
from .test_gateway import API_KEY, gateway

WAIT = 60.0
# A key whose scope grants everything, where the gateway has scopes.
ALL_KEY = "mcp-all-2b7d4f6a8c1e3b5d"


@contextmanager
def demo_with_gateway(server: NatsServer, tmp_path: Path, extra: str = "") -> Iterator[tuple[ChorusProcess, str]]:
    """The gateway (identity `mcp-host`) and the demo's agents (`chorus up --join`), after the
    demo's first round (so its own tasks are done); yields the demo and the MCP endpoint."""
    with gateway(server, tmp_path, "mcp-host", extra) as port:
        demo = ChorusProcess(server.url, "up", "--join", "--interval", "3600s", "--metrics-addr", f"127.0.0.1:{_free_port()}")
        try:
            demo.wait_for("chorus up: scenarios complete", 120)
            yield demo, f"http://127.0.0.1:{port}/mcp"
        finally:
            demo.stop()


async def connect(stack: AsyncExitStack, url: str, key: str = API_KEY, **session: Any) -> ClientSession:
    http = await stack.enter_async_context(httpx2.AsyncClient(headers={"X-API-Key": key}, timeout=WAIT))
    read, write = await stack.enter_async_context(streamable_http_client(url, http_client=http))
    client = await stack.enter_async_context(ClientSession(read, write, **session))
    await asyncio.wait_for(client.initialize(), WAIT)
    return client


def text_of(result: Any) -> str:
    return "\n".join(c.text for c in result.content if getattr(c, "type", "") == "text")


def test_an_mcp_client_lists_calls_streams_and_cancels_chorus_agents(server: NatsServer, tmp_path: Path) -> None:
    async def run(demo: ChorusProcess, url: str) -> None:
        logs: list[str] = []

        async def logged(params: Any) -> None:
            logs.append(str(params.data))

        async with AsyncExitStack() as stack:
            client = await connect(stack, url, logging_callback=logged)
            tools = {t.name: t for t in (await asyncio.wait_for(client.list_tools(), WAIT)).tools}
            for name in ("calculator.calculation", "writer.draft", "researcher.research", "ocr"):
                assert name in tools, sorted(tools)
            calculation = tools["calculator.calculation"]
            assert calculation.input_schema["required"] == ["operation", "operands"]
            assert tools["writer.draft"].input_schema["properties"]["input"]["type"] == "string"

            added = await asyncio.wait_for(
                client.call_tool("calculator.calculation", {"operation": "add", "operands": [2, 3.5]}), WAIT)
            assert not added.is_error and text_of(added) == "5.5"

            by_zero = await asyncio.wait_for(
                client.call_tool("calculator.calculation", {"operation": "divide", "operands": [1, 0]}), WAIT)
            assert by_zero.is_error, by_zero
            assert text_of(by_zero).startswith("5018 "), text_of(by_zero)
            assert "division by zero" in text_of(by_zero)
            assert by_zero.structured_content == {
                "status": 5018, "label": "invalid_argument", "reason": "division by zero"}

            # Arguments the schema refuses never reach the agent.
            bad = await asyncio.wait_for(
                client.call_tool("calculator.calculation", {"operation": "modulo", "operands": [1]}), WAIT)
            assert bad.is_error and "input schema" in text_of(bad), text_of(bad)

            with pytest.raises(MCPError) as unknown:
                await asyncio.wait_for(client.call_tool("nobody.nothing", {}), WAIT)
            assert unknown.value.error.code == -32602

            progress: list[float] = []

            async def progressed(done: float, total: float | None, message: str | None) -> None:
                progress.append(done)

            drafted = await asyncio.wait_for(
                client.call_tool("writer.draft", {"input": "rivers"}, progress_callback=progressed), WAIT)
            assert not drafted.is_error, text_of(drafted)
            # The chunks streamed, then the result (the word count).
            words = "rivers on the wire / each token finds its listener / the stream never gaps"
            assert [c.text for c in drafted.content] == [words, str(len(words.split()))]
            assert len(progress) == len(words.split()) and progress == sorted(progress), progress
            assert progress[-1] == 100
            assert "writing" in logs

            # The researcher works until cancelled: the call is abandoned at its first progress,
            # the client sends notifications/cancelled, and the task is cancelled on the bus.
            started = asyncio.Event()

            async def researching(done: float, total: float | None, message: str | None) -> None:
                started.set()

            call = asyncio.ensure_future(
                client.call_tool("researcher.research", {"input": "tides"}, progress_callback=researching))
            await asyncio.wait_for(started.wait(), WAIT)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            # With the session still open: the client's notification is sent after the call
            # ends, and closing the session at once may drop it (a cancel is best effort).
            await asyncio.get_running_loop().run_in_executor(None, demo.wait_for, "researcher stops")

    with demo_with_gateway(server, tmp_path) as (demo, url):
        asyncio.run(run(demo, url))


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, body, {
        "Content-Type": "application/json", "Accept": "application/json",
        "X-API-Key": ALL_KEY, **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw else None


def test_bad_input_gets_the_right_json_rpc_answer_never_a_500(server: NatsServer, tmp_path: Path) -> None:
    def key(secret: str, scope: str) -> str:
        digest = hashlib.sha256(secret.encode()).hexdigest()
        return f'[[gateway.api_keys]]\nidentity = "mcp-host"\nsha256 = "{digest}"\nscopes = ["{scope}"]\n'

    scopes = (
        "max_body_bytes = 4096\n"
        '[[gateway.scopes]]\nname = "all"\nroutes = ["*"]\nagents = ["*"]\ncapabilities = ["*"]\n'
        '[[gateway.scopes]]\nname = "math"\nroutes = ["mcp"]\nagents = ["calculator"]\n'
        + key(ALL_KEY, "all") + key("math-key", "math")
    )
    with demo_with_gateway(server, tmp_path, scopes) as (_, url):
        ping = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}).encode()
        status, parsed = post(url, b"{not json")
        assert status == 400 and parsed["error"]["code"] == -32700 and parsed["id"] is None
        status, batch = post(url, b"[" + ping + b"]")
        assert status == 400 and batch["error"]["code"] == -32600 and "batch" in batch["error"]["message"]
        status, no_version = post(url, json.dumps({"id": 1, "method": "ping"}).encode())
        assert status == 400 and no_version["error"]["code"] == -32600 and no_version["id"] == 1
        status, null_id = post(url, json.dumps({"jsonrpc": "2.0", "id": None, "method": "ping"}).encode())
        assert status == 400 and null_id["error"]["code"] == -32600
        assert post(url, ping) == (200, {"jsonrpc": "2.0", "id": 1, "result": {}})
        status, unknown = post(url, json.dumps({"jsonrpc": "2.0", "id": 2, "method": "resources/list"}).encode())
        assert status == 200 and unknown["error"]["code"] == -32601
        huge = json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
            "name": "calculator.calculation", "arguments": {"operation": "add", "operands": [1] * 5000}}}).encode()
        status, too_big = post(url, huge)
        assert status == 413 and too_big["error"]["code"] == -32600, (status, too_big)
        status, anonymous = post(url, ping, {"X-API-Key": "wrong"})
        assert status == 401, anonymous
        status, rebinding = post(url, ping, {"Origin": "http://evil.example"})
        assert status == 403 and rebinding["error"]["code"] == -32600
        status, old = post(url, ping, {"MCP-Protocol-Version": "2024-01-01"})
        assert status == 400
        status, gone = post(url, ping, {"Mcp-Session-Id": "no-such-session"})
        assert status == 404
        # A scope that grants the calculator lists and calls it only.
        listed = json.dumps({"jsonrpc": "2.0", "id": 4, "method": "tools/list"}).encode()
        status, tools = post(url, listed, {"X-API-Key": "math-key"})
        assert status == 200 and [t["name"] for t in tools["result"]["tools"]] == ["calculator.calculation"]
        call = json.dumps({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {
            "name": "writer.draft", "arguments": {"input": "x"}}}).encode()
        status, refused = post(url, call, {"X-API-Key": "math-key"})
        assert status == 200 and refused["error"]["code"] == -32602, refused


SERVERS = Path(__file__).resolve().parent / "servers"


def chorus(server: NatsServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([rust_binary("chorus"), "--server", server.url, *args], capture_output=True, text=True,
                          timeout=WAIT, env={**os.environ, "RUST_LOG": "warn"})


def holders(port: int, capability: str) -> list[str]:
    """The live agents offering `capability`, as the gateway's registry route lists them."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/agents?capability={capability}",
                                     headers={"X-API-Key": API_KEY})
    with urllib.request.urlopen(request, timeout=WAIT) as r:
        return [a["id"] for a in json.loads(r.read())["agents"]]


def test_an_mcp_server_bridged_onto_the_bus_serves_dies_and_comes_back(
        server: NatsServer, tmp_path: Path, rust_peer: Any) -> None:
    from chorus_sdk import Agent

    with gateway(server, tmp_path, "mcp-host") as port:
        peer = rust_peer("rust-bridge-caller")
        bridge = ChorusProcess(server.url, "mcp", "bridge", "--agent", "mcp-math", "--",
                         sys.executable, str(SERVERS / "mcp_math.py"))
        try:
            bridge.wait_for("mcp-math offers 3 tool(s)")
            added = chorus(server, "request", "--capability", "mcp-math.add", '{"a": 2, "b": 3}')
            assert added.returncode == 0, added.stderr
            assert json.loads(added.stdout)["structuredContent"] == {"result": 5.0}, added.stdout
            refused = chorus(server, "request", "--capability", "mcp-math.divide", '{"a": 1, "b": 0}')
            assert refused.returncode != 0
            assert "5017" in refused.stderr + refused.stdout and "division by zero" in refused.stderr + refused.stdout

            async def from_rust() -> Any:
                async with Agent("py-bridge-test", servers=server.url, heartbeat_interval=0) as py:
                    return await py.request(peer.id, "ask_capability",
                                            {"capability": "mcp-math.add", "payload": {"a": 1.5, "b": 2}})

            assert asyncio.run(from_rust())["structuredContent"] == {"result": 3.5}

            # Through the gateway's MCP server, the bridged tool is a tool again, its schema kept.
            listed = post(f"http://127.0.0.1:{port}/mcp",
                          json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode(), {"X-API-Key": API_KEY})
            tool = next(t for t in listed[1]["result"]["tools"] if t["name"] == "mcp-math.add")
            assert tool["inputSchema"]["required"] == ["a", "b"], tool

            first = json.loads(chorus(server, "request", "--capability", "mcp-math.pid").stdout)["structuredContent"]["result"]
            os.kill(first, 9)
            killed = time.monotonic()
            while "mcp-math" in holders(port, "mcp-math.add"):
                assert time.monotonic() - killed < 5.0, "the bridged capability outlived its server by a heartbeat"
                time.sleep(0.05)
            bridge.wait_for("restarting the MCP server")
            bridge.wait_for("mcp-math offers 3 tool(s)")
            second = json.loads(chorus(server, "request", "--capability", "mcp-math.pid").stdout)["structuredContent"]["result"]
            assert second != first
            again = chorus(server, "request", "--capability", "mcp-math.add", '{"a": 4, "b": 4}')
            assert json.loads(again.stdout)["structuredContent"] == {"result": 8.0}, again.stderr
        finally:
            bridge.stop()


def test_the_tool_list_follows_agents_and_stdio_serves_the_same_tools(
        server: NatsServer, tmp_path: Path, rust_peer: Any) -> None:
    from mcp.client.stdio import StdioServerParameters, stdio_client

    async def run(url: str) -> None:
        # Streamable HTTP: GET /mcp is told when an agent comes.
        async with httpx2.AsyncClient(headers={"X-API-Key": API_KEY}, timeout=WAIT) as http:
            async with http.stream("GET", url, headers={"Accept": "text/event-stream"}) as stream:
                assert stream.status_code == 200
                await asyncio.get_running_loop().run_in_executor(None, rust_peer, "rust-newcomer")

                async def changed() -> None:
                    async for line in stream.aiter_lines():
                        if line.startswith("data:") and "notifications/tools/list_changed" in line:
                            return

                await asyncio.wait_for(changed(), WAIT)
        # Standard input and output: `chorus mcp serve --stdio`, as a desktop host starts it.
        command = StdioServerParameters(
            command=rust_binary("chorus"),
            args=["--server", server.url, "mcp", "serve", "--stdio", "--identity", "desktop-host"],
            env={"RUST_LOG": "warn"})
        async with AsyncExitStack() as stack:
            read, write = await stack.enter_async_context(stdio_client(command))
            client = await stack.enter_async_context(ClientSession(read, write))
            await asyncio.wait_for(client.initialize(), WAIT)
            names = {t.name for t in (await asyncio.wait_for(client.list_tools(), WAIT)).tools}
            assert {"rust-newcomer.echo", "interop.upper"} <= names, sorted(names)
            echoed = await asyncio.wait_for(client.call_tool("rust-newcomer.echo", {"n": 7}), WAIT)
            assert not echoed.is_error and echoed.structured_content == {"n": 7}, echoed
            failed = await asyncio.wait_for(client.call_tool("rust-newcomer.fail", {}), WAIT)
            assert failed.is_error and text_of(failed).startswith("5018 "), text_of(failed)

    with gateway(server, tmp_path, "mcp-host") as port:
        asyncio.run(run(f"http://127.0.0.1:{port}/mcp"))


def test_long_work_runs_as_mcp_tasks_on_chorus_tasks(server: NatsServer, tmp_path: Path) -> None:
    with demo_with_gateway(server, tmp_path) as (demo, url):
        headers = {"X-API-Key": API_KEY}

        def rpc(method: str, params: dict[str, Any]) -> Any:
            status, answer = post(url, json.dumps({"jsonrpc": "2.0", "id": 1, "method": method,
                                                   "params": params}).encode(), headers)
            assert status == 200, answer
            return answer

        init = rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                  "clientInfo": {"name": "t", "version": "1"}})
        assert init["result"]["capabilities"]["tasks"]["requests"] == {"tools": {"call": {}}}
        tools = {t["name"]: t for t in rpc("tools/list", {})["result"]["tools"]}
        assert tools["writer.draft"]["execution"] == {"taskSupport": "optional"}
        assert "execution" not in tools["calculator.calculation"]

        # A task-augmented call answers at once with the task; its id is the Chorus task's.
        created = rpc("tools/call", {"name": "writer.draft", "arguments": {"input": "rivers"}, "task": {}})
        task = created["result"]["task"]
        assert task["status"] in ("working", "completed") and task["pollInterval"] > 0, task
        shown = chorus(server, "task", "show", task["taskId"], "--json")
        assert shown.returncode == 0 and json.loads(shown.stdout)["target"] == "writer.draft", shown.stdout
        result = rpc("tasks/result", {"taskId": task["taskId"]})["result"]
        assert [c["text"] for c in result["content"]][1] == "15", result
        assert result["_meta"]["io.modelcontextprotocol/related-task"] == {"taskId": task["taskId"]}
        done = rpc("tasks/get", {"taskId": task["taskId"]})["result"]
        assert done["status"] == "completed" and done["createdAt"] <= done["lastUpdatedAt"], done

        # A tool that is no task takes no task; an unknown task is not found.
        assert rpc("tools/call", {"name": "calculator.calculation", "task": {},
                                  "arguments": {"operation": "add", "operands": [1]}})["error"]["code"] == -32601
        assert rpc("tasks/get", {"taskId": "0190d5b2-0000-7000-8000-000000000000"})["error"]["code"] == -32602

        # Cancelled: on the bus too (the researcher stops), and once only.
        research = rpc("tools/call", {"name": "researcher.research", "arguments": {"input": "tides"},
                                      "task": {"ttl": 60000}})["result"]["task"]
        deadline = time.monotonic() + WAIT
        while rpc("tasks/get", {"taskId": research["taskId"]})["result"].get("statusMessage", "").find("reading") < 0:
            assert time.monotonic() < deadline, "the researcher did not start"
            time.sleep(0.05)
        cancelled = rpc("tasks/cancel", {"taskId": research["taskId"]})["result"]
        assert cancelled["status"] in ("working", "cancelled"), cancelled
        demo.wait_for("researcher stops")
        while rpc("tasks/get", {"taskId": research["taskId"]})["result"]["status"] != "cancelled":
            assert time.monotonic() < deadline, "the task was not recorded cancelled"
            time.sleep(0.05)
        assert rpc("tasks/cancel", {"taskId": research["taskId"]})["error"]["code"] == -32602
        failed = rpc("tasks/result", {"taskId": research["taskId"]})["result"]
        assert failed["isError"] and failed["content"][0]["text"].startswith("50"), failed


async def sse_events(stream: Any) -> Any:
    """A server-sent event stream's events, each as (its id or None, its data or "")."""
    event_id, data = None, []
    async for line in stream.aiter_lines():
        if line == "":
            yield event_id, "\n".join(data)
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def test_a_broken_task_stream_resumes_after_its_last_event(server: NatsServer, tmp_path: Path) -> None:
    async def run(url: str) -> None:
        headers = {"X-API-Key": API_KEY, "Accept": "application/json, text/event-stream"}
        call = {"jsonrpc": "2.0", "id": "call-7", "method": "tools/call", "params": {
            "name": "researcher.research", "arguments": {"input": "tides"}, "_meta": {"progressToken": "p"}}}
        async with httpx2.AsyncClient(headers=headers, timeout=WAIT) as http:
            last_id, seen, primed = None, [], False
            async with http.stream("POST", url, json=call) as stream:
                assert stream.status_code == 200
                async for event_id, data in sse_events(stream):
                    if event_id and not data:
                        primed = True  # the priming event: an id, no data
                    elif data and json.loads(data).get("method") == "notifications/progress":
                        seen.append(json.loads(data)["params"]["progress"])
                    if event_id:
                        last_id = event_id
                    if len(seen) == 2 and event_id:
                        break  # the connection breaks here, after the second update's events
            assert primed and last_id is not None and seen == sorted(seen)
            task = last_id.split(".")[0]
            # The client comes back after its last event: the progress goes on from there.
            resumed: list[float] = []
            async with http.stream("GET", url, headers={"Last-Event-ID": last_id}) as stream:
                assert stream.status_code == 200
                async for _, data in sse_events(stream):
                    if not data:
                        continue
                    message = json.loads(data)
                    if message.get("method") == "notifications/progress":
                        resumed.append(message["params"]["progress"])
                        if len(resumed) == 2:
                            # Ended from elsewhere: the resumed stream answers the call.
                            done = await http.post(url, json={"jsonrpc": "2.0", "id": 9, "method": "tasks/cancel",
                                                              "params": {"taskId": str(uuid.UUID(task))}},
                                                   headers={"Accept": "application/json"})
                            assert done.status_code == 200, done.text
                    elif message.get("id") == "call-7":
                        assert message["result"]["isError"], message
                        break
            assert resumed[0] > seen[-1] and resumed == sorted(resumed), (seen, resumed)
            bad = await http.get(url, headers={"Last-Event-ID": "not-ours"})
            assert bad.status_code == 400

    with demo_with_gateway(server, tmp_path) as (_, url):
        asyncio.run(run(url))


def test_ending_a_session_cancels_the_tasks_its_calls_started(server: NatsServer, tmp_path: Path) -> None:
    """A client that leaves its call's stream and ends its session (DELETE) without a
    `notifications/cancelled`: no one can take the call's answer now, so its task is cancelled."""
    async def run(demo: ChorusProcess, url: str) -> None:
        headers = {"X-API-Key": API_KEY, "Accept": "application/json, text/event-stream"}
        async with httpx2.AsyncClient(headers=headers, timeout=WAIT) as http:
            opened = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "leaver", "version": "1"}}})
            assert opened.status_code == 200, opened.text
            session = {"Mcp-Session-Id": opened.headers["mcp-session-id"]}
            call = {"jsonrpc": "2.0", "id": "call-1", "method": "tools/call", "params": {
                "name": "researcher.research", "arguments": {"input": "tides"}, "_meta": {"progressToken": "p"}}}
            async with http.stream("POST", url, json=call, headers=session) as stream:
                assert stream.status_code == 200
                async for _, data in sse_events(stream):
                    if data and json.loads(data).get("method") == "notifications/progress":
                        break  # the client leaves the stream at the first progress
            ended = await http.delete(url, headers=session)
            assert ended.status_code == 204, ended.text
        await asyncio.get_running_loop().run_in_executor(None, demo.wait_for, "researcher stops")

    with demo_with_gateway(server, tmp_path) as (demo, url):
        asyncio.run(run(demo, url))


def test_an_mcp_server_over_streamable_http_is_bridged_and_missed_when_it_stops(
        server: NatsServer, tmp_path: Path) -> None:
    port = _free_port()
    http_server = subprocess.Popen([sys.executable, str(SERVERS / "mcp_math.py"), "--http", str(port)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with gateway(server, tmp_path, "mcp-host") as gateway_port:
            bridge = ChorusProcess(server.url, "mcp", "bridge", "--agent", "mcp-remote", "--heartbeat", "1s",
                             "--url", f"http://127.0.0.1:{port}/mcp")
            try:
                # The server may still be starting: the bridge retries with backoff.
                bridge.wait_for("mcp-remote offers 3 tool(s)")
                added = chorus(server, "request", "--capability", "mcp-remote.add", '{"a": 20, "b": 22}')
                assert added.returncode == 0, added.stderr
                assert json.loads(added.stdout)["structuredContent"] == {"result": 42.0}
                refused = chorus(server, "request", "--capability", "mcp-remote.divide", '{"a": 1, "b": 0}')
                assert refused.returncode != 0 and "division by zero" in refused.stderr + refused.stdout
                # The server stops: three missed pings (a second apart) and its tools leave.
                http_server.terminate()
                http_server.wait(timeout=WAIT)
                stopped = time.monotonic()
                bridge.wait_for("is gone; its tools are withdrawn")
                while "mcp-remote" in holders(gateway_port, "mcp-remote.add"):
                    assert time.monotonic() - stopped < WAIT, "the bridged capability outlived its server"
                    time.sleep(0.1)
            finally:
                bridge.stop()
    finally:
        if http_server.poll() is None:
            http_server.kill()
            http_server.wait()


def test_a_python_agent_describes_its_tools_as_a_rust_one_does(server: NatsServer, tmp_path: Path) -> None:
    from chorus_sdk import Agent, Context

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5}, "note": {"default": None}},
              "required": ["n"]}

    async def run(url: str) -> None:
        async with Agent("py-tools", servers=server.url, heartbeat_interval=0.5) as py:
            @py.command("double")
            async def double(ctx: Context) -> int:
                return int(ctx.data()["n"]) * 2

            py.describe("double", "Doubles n.", input_schema=schema)
            with pytest.raises(ValueError):
                py.describe("nothing", "not served")
            with pytest.raises(ValueError):
                py.describe("double", "x" * 1025)
            async with AsyncExitStack() as stack:
                client = await connect(stack, url)
                deadline = time.monotonic() + WAIT
                while True:
                    tools = {t.name: t for t in (await client.list_tools()).tools}
                    if "py-tools.double" in tools and tools["py-tools.double"].description == "Doubles n.":
                        break
                    assert time.monotonic() < deadline, sorted(tools)
                    await asyncio.sleep(0.2)
                assert tools["py-tools.double"].input_schema == schema
                doubled = await asyncio.wait_for(client.call_tool("py-tools.double", {"n": -3}), WAIT)
                assert text_of(doubled) == "-6"
                refused = await asyncio.wait_for(client.call_tool("py-tools.double", {"n": "x"}), WAIT)
                assert refused.is_error and "/n" in text_of(refused)

    with gateway(server, tmp_path, "mcp-host") as port:
        asyncio.run(run(f"http://127.0.0.1:{port}/mcp"))


def test_the_interop_bridge_block_runs_as_written(server: NatsServer, tmp_path: Path) -> None:
    import shlex

    from .conftest import REPO

    doc = (REPO / "docs" / "INTEROP.md").read_text()
    block = doc.split("**Any MCP server joins the bus as an agent.**")[1].split("```sh\n")[1].split("```")[0]
    bridge_line, request_line = [line for line in block.splitlines() if line and not line.startswith("#")]
    with gateway(server, tmp_path, "mcp-host"):
        args = shlex.split(bridge_line)
        assert args[0] == "chorus"
        bridge = ChorusProcess(server.url, *args[1:], cwd=REPO)
        try:
            bridge.wait_for("offers 3 tool(s)")
            command = request_line.replace("chorus ", f"{rust_binary('chorus')} ", 1)
            done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=WAIT, cwd=REPO,
                                  env={**os.environ, "CHORUS_NATS_URL": server.url, "RUST_LOG": "warn"})
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["structuredContent"] == {"result": 5.0}, done.stdout
        finally:
            bridge.stop()
