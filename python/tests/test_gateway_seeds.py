"""The seeds' own clients at the edge (docs/INTEROP.md, "The seeds' own clients: IACP and
Agentify"), against a running `chorus serve` with its gateway: IACP's reference client, copied
here as the seed writes it, discovers a Python agent by capability, sends it a request and polls
the reply (and an error for an agent nobody serves); Agentify's WebSocket example frames, sent as
the seed writes them, reach a calculator agent on the bus and come back as `inform` frames, and
the `task` they state is carried to the handler and shown by the console's live traffic."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chorus_sdk import ChorusError, Context, StatusCode

from .conftest import _free_port, py_agent
from .test_gateway import API_KEY, gateway

WAIT = 20.0


# ---------------------------------------------------------------------------------------------
# IACP's reference client, from the seed (section 5, "Agent Adoption Instructions"), unchanged
# but for the indentation the seed's text lost.

"""IACP client — stdlib only, zero dependencies."""
import json, time, uuid  # noqa: E401,E402,F811
import urllib.request, urllib.error  # noqa: E401,E402,F811

DEFAULT_REGISTRY = "https://workswithagents.dev"

class IACPClient:
    def __init__(self, agent_id: str, api: str = DEFAULT_REGISTRY):
        self.agent_id = agent_id
        self.api = api.rstrip("/")

    def discover(self, capability: str = None) -> list:  # type: ignore[assignment]
        """Discover peers by capability."""
        url = f"{self.api}/v1/peers"
        if capability:
            url += f"?capability={capability}"
        req = urllib.request.Request(url, headers={
            "X-Agent-ID": self.agent_id,
            "Accept": "application/json"
        })
        with urllib.request.urlopen(req) as resp:
            return json.loads(resp.read())

    def send(self, to_agent: str, intent: str, payload: dict) -> str:
        """Send an IACP message. Returns message_id."""
        msg_id = str(uuid.uuid4())
        envelope = {
            "version": "1.0",
            "message_id": msg_id,
            "sender": {"agent_id": self.agent_id},
            "recipient": {"agent_id": to_agent},
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "message": {"type": "request", "intent": intent, "payload": payload}
        }
        data = json.dumps(envelope).encode()
        req = urllib.request.Request(f"{self.api}/v1/messages", data=data,
            method="POST", headers={
                "Content-Type": "application/json",
                "X-Agent-ID": self.agent_id
            })
        with urllib.request.urlopen(req) as resp:
            result = json.loads(resp.read())
            return result.get("message_id", msg_id)

    def poll(self) -> list:
        """Poll for messages addressed to this agent."""
        req = urllib.request.Request(
            f"{self.api}/v1/messages?recipient={self.agent_id}",
            headers={"X-Agent-ID": self.agent_id, "Accept": "application/json"})
        with urllib.request.urlopen(req) as resp:
            return json.loads(resp.read())

# Usage:
# client = IACPClient("builder-01")
# peers = client.discover("code_review")
# msg_id = client.send("reviewer-02", "handoff", {"task": "Review src/main.py"})
# inbox = client.poll()

# ---------------------------------------------------------------------------------------------


@pytest.fixture
def api_key_everywhere() -> Iterator[None]:
    """The seed's client sends no credentials: an opener installed for every urllib call adds
    the gateway's API key, so the client's code stays as the seed writes it."""
    opener = urllib.request.build_opener()
    opener.addheaders = [("X-API-Key", API_KEY)]
    urllib.request.install_opener(opener)
    try:
        yield
    finally:
        urllib.request.install_opener(urllib.request.build_opener())


async def _poll_until(client: IACPClient, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first envelope of the client's polls that ``match`` takes, within WAIT seconds."""
    deadline = time.monotonic() + WAIT
    seen: list[dict[str, Any]] = []
    while True:
        seen.extend(await asyncio.to_thread(client.poll))
        for envelope in seen:
            if match(envelope):
                return envelope
        if time.monotonic() > deadline:
            raise AssertionError(f"no matching envelope within {WAIT} s; polled {seen}")
        await asyncio.sleep(0.05)


async def test_the_iacp_reference_client_discovers_sends_and_polls_the_reply(
    server: Any, tmp_path: Path, api_key_everywhere: None
) -> None:
    handoffs: list[Any] = []
    with gateway(server, tmp_path, "builder-01") as port:
        async with py_agent(server, "reviewer-02", heartbeat_interval=0.2) as reviewer:

            @reviewer.capability("code_review")
            async def review(ctx: Context) -> Any:
                return {"issues": 3}

            @reviewer.command("handoff")
            async def handoff(ctx: Context) -> Any:
                handoffs.append((ctx.sender, ctx.data(), dict(ctx.headers)))
                return {"accepted": True, "eta_seconds": 120, "task": ctx.data()["task"]}

            client = IACPClient("builder-01", api=f"http://127.0.0.1:{port}")

            # Discover: the Python agent shows up as a peer with its capability.
            deadline = time.monotonic() + WAIT
            while True:
                peers = await asyncio.to_thread(client.discover, "code_review")
                if any(p["agent_id"] == "reviewer-02" for p in peers):
                    break
                assert time.monotonic() < deadline, f"reviewer-02 not discovered: {peers}"
                await asyncio.sleep(0.1)
            peer = next(p for p in peers if p["agent_id"] == "reviewer-02")
            assert [c["name"] for c in peer["capabilities"]] == ["code_review"]
            assert "handoff" in peer["commands"]
            assert peer["availability"] == "available" and 0.0 <= peer["load"] <= 1.0
            assert await asyncio.to_thread(client.discover, "no_such_capability") == []

            # Send, as the seed's usage does, and poll the reply: a response correlated to it.
            msg_id = await asyncio.to_thread(client.send, "reviewer-02", "handoff", {"task": "Review src/main.py"})
            reply = await _poll_until(client, lambda e: e.get("correlation_id") == msg_id)
            assert reply["message"]["type"] == "response"
            assert reply["message"]["intent"] == "handoff"
            assert reply["message"]["payload"] == {"accepted": True, "eta_seconds": 120, "task": "Review src/main.py"}
            assert reply["sender"] == {"agent_id": "reviewer-02"}
            assert reply["recipient"] == {"agent_id": "builder-01"}
            # The agent got it from the caller's identity, the intent as a header.
            assert handoffs[0][:2] == ("builder-01", {"task": "Review src/main.py"})
            assert handoffs[0][2].get("iacp-intent") == "handoff"

            # An agent nobody serves: the poll returns an IACP error with the Chorus code.
            lost = await asyncio.to_thread(client.send, "nobody-here", "handoff", {"task": "x"})
            error = await _poll_until(client, lambda e: e.get("correlation_id") == lost)
            assert error["message"]["type"] == "error"
            assert error["message"]["payload"]["code"] == StatusCode.NO_RESPONDERS
            assert error["message"]["payload"]["label"] == "no_responders"

            # A message another agent sends to the client's identity is in its poll as an IACP
            # request; an IACP response envelope naming it answers the waiting agent.
            asked = asyncio.create_task(reviewer.request("builder-01", "review", {"file": "src/main.py"}, timeout=WAIT))
            request = await _poll_until(client, lambda e: e["message"]["type"] == "request")
            assert request["sender"] == {"agent_id": "reviewer-02"}
            assert (request["recipient"]["channel"], request["message"]["payload"]) == ("review", {"file": "src/main.py"})
            answer = {
                "version": "1.0",
                "message_id": str(uuid.uuid4()),
                "correlation_id": request["message_id"],
                "sender": {"agent_id": "builder-01"},
                "recipient": {"agent_id": "reviewer-02"},
                "message": {"type": "response", "intent": "review", "payload": {"looks": "good"}},
            }
            posted = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/messages", data=json.dumps(answer).encode(), method="POST",
                headers={"Content-Type": "application/json", "X-Agent-ID": "builder-01"},
            )
            await asyncio.to_thread(urllib.request.urlopen, posted)
            assert await asyncio.wait_for(asked, WAIT) == {"looks": "good"}
            # An IACP error envelope refuses one with its code.
            asked = asyncio.create_task(reviewer.request("builder-01", "review", {"file": "b.py"}, timeout=WAIT))
            request = await _poll_until(client, lambda e: e["message"]["type"] == "request")
            refusal = dict(answer, correlation_id=request["message_id"],
                           message={"type": "error", "payload": {"code": 5018, "message": "no such file"}})
            posted = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/messages", data=json.dumps(refusal).encode(), method="POST",
                headers={"Content-Type": "application/json"},
            )
            await asyncio.to_thread(urllib.request.urlopen, posted)
            with pytest.raises(ChorusError) as refused:
                await asyncio.wait_for(asked, WAIT)
            assert (refused.value.status, refused.value.reason) == (StatusCode.INVALID_ARGUMENT, "no such file")

            # The client may speak only as its own identity: another X-Agent-ID or sender is 403.
            with pytest.raises(urllib.error.HTTPError) as forbidden:
                await asyncio.to_thread(IACPClient("someone-else", api=client.api).send, "reviewer-02", "handoff", {})
            assert forbidden.value.code == 403
            assert json.loads(forbidden.value.read())["status"] == StatusCode.ACCESS
            with pytest.raises(urllib.error.HTTPError) as forbidden:
                await asyncio.to_thread(IACPClient("someone-else", api=client.api).poll)
            assert forbidden.value.code == 403
            # Malformed envelopes are refused with the reason.
            for bad, why in [
                ({"version": "2.0"}, "version"),
                ({"recipient": {"agent_id": "a.b"}}, "recipient.agent_id"),
                ({"message": {"type": "heartbeat", "intent": "health"}}, "heartbeat"),
            ]:
                envelope = {
                    "version": "1.0",
                    "recipient": {"agent_id": "reviewer-02"},
                    "message": {"type": "request", "intent": "handoff", "payload": {}},
                    **bad,
                }
                posted = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/messages", data=json.dumps(envelope).encode(), method="POST",
                    headers={"Content-Type": "application/json"},
                )
                with pytest.raises(urllib.error.HTTPError) as malformed:
                    await asyncio.to_thread(urllib.request.urlopen, posted)
                assert malformed.value.code == 400
                assert why in json.loads(malformed.value.read())["reason"]


async def test_the_iacp_capability_query_is_answered_from_the_registry(
    server: Any, tmp_path: Path, api_key_everywhere: None
) -> None:
    """IACP's capability query (section 3, "Capability Query/Response"), sent with the seed's
    own ``send``: the registry answers with the recipient's capability manifest, its ETA from
    the handling times it announces, or an error when it does not match."""
    async def review(ctx: Context) -> Any:
        await asyncio.sleep(0.03)
        return {"issues": 0}

    with gateway(server, tmp_path, "builder-01") as port:
        async with py_agent(
            server, "reviewer-02", heartbeat_interval=0.2, capability_max_tokens={"code_review": 8192}
        ) as reviewer, py_agent(
            server, "reviewer-03", heartbeat_interval=0.2, capability_max_tokens={"code_review": 1024}
        ) as small:
            reviewer.capability("code_review")(review)
            reviewer.capability("testing")(review)
            reviewer.command("warm")(review)
            small.capability("code_review")(review)
            await reviewer.flush()
            await small.flush()
            client = IACPClient("builder-01", api=f"http://127.0.0.1:{port}")
            # Two handled requests give reviewer-02 a handling time, hence an ETA.
            for _ in range(2):
                warm = await asyncio.to_thread(client.send, "reviewer-02", "warm", {})
                await _poll_until(client, lambda e, w=warm: e.get("correlation_id") == w)  # type: ignore[misc]
            query = {"capabilities": ["code_review", "testing"], "max_tokens": 4096, "priority": "high"}

            async def manifest() -> dict[str, Any]:
                asked = await asyncio.to_thread(client.send, "reviewer-02", "query", query)
                return await _poll_until(client, lambda e: e.get("correlation_id") == asked)

            deadline = time.monotonic() + WAIT
            while "eta_seconds" not in (answer := await manifest())["message"]["payload"]:
                assert time.monotonic() < deadline, f"no ETA announced: {answer}"
                await asyncio.sleep(0.1)
            assert answer["message"]["type"] == "response" and answer["message"]["intent"] == "query"
            assert answer["sender"] == {"agent_id": "reviewer-02"}
            payload = answer["message"]["payload"]
            # As the seed's response writes it: capabilities, availability, load, eta_seconds.
            assert {c["name"] for c in payload["capabilities"]} == {"code_review", "testing"}
            review_cap = next(c for c in payload["capabilities"] if c["name"] == "code_review")
            assert review_cap["max_tokens"] == 8192
            assert payload["availability"] == "available" and 0.0 <= payload["load"] <= 1.0
            assert payload["eta_seconds"] >= 1, payload

            # reviewer-03 offers code_review only, for 1024 tokens: it does not match.
            asked = await asyncio.to_thread(client.send, "reviewer-03", "query", query)
            error = await _poll_until(client, lambda e: e.get("correlation_id") == asked)
            assert error["message"]["type"] == "error"
            assert error["message"]["payload"]["code"] == StatusCode.NO_RESPONDERS

            # Naming no agent, the registry answers with every peer that matches.
            envelope = {
                "version": "1.0", "message_id": str(uuid.uuid4()), "sender": {"agent_id": "builder-01"},
                "message": {"type": "request", "intent": "query", "payload": {"capabilities": ["code_review"], "max_tokens": 2048}},
            }
            posted = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/messages", data=json.dumps(envelope).encode(), method="POST",
                headers={"Content-Type": "application/json", "X-Agent-ID": "builder-01"},
            )
            await asyncio.to_thread(urllib.request.urlopen, posted)
            listed = await _poll_until(client, lambda e: e.get("correlation_id") == envelope["message_id"])
            assert listed["sender"] == {"agent_id": "registry"}
            assert [p["agent_id"] for p in listed["message"]["payload"]["peers"]] == ["reviewer-02"]
            # The same filters on /v1/peers, and a bad one refused by name.
            url = f"http://127.0.0.1:{port}/v1/peers?capabilities=code_review,testing&max_tokens=4096&priority=low"
            with await asyncio.to_thread(urllib.request.urlopen, url) as got:
                assert [p["agent_id"] for p in json.loads(got.read())] == ["reviewer-02"]
            with pytest.raises(urllib.error.HTTPError) as bad:
                await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{port}/v1/peers?priority=urgent")
            assert bad.value.code == 400 and "priority" in json.loads(bad.value.read())["reason"]


# ---------------------------------------------------------------------------------------------
# Agentify over the WebSocket: the seed's frames, as written there.

# "WebSocket Transport", Client -> Server.
SEED_WS_REQUEST = """{
  "type": "request",
  "sender": "agent.app.orchestrator",
  "to": ["agent.calculator.calculation"],
  "intent": "calculate",
  "payload": { "a": 5, "b": 3, "op": "+" }
}"""

# "Discovery Flow", App Orchestrator -> Marketplace Orchestrator.
SEED_DISCOVER = {
    "type": "discover",
    "sender": "agent.app.orchestrator",
    "to": ["agent.marketplace.orchestrator"],
    "intent": "find_agent",
    "payload": {"capability": "calculation", "customer_id": "customer-123"},
}

# "Base Message", with its natural-language task, context, correlation and expectation.
SEED_BASE_MESSAGE = {
    "id": "msg-uuid-123",
    "ts": "2026-01-16T10:30:00Z",
    "type": "request",
    "sender": "agent.app.orchestrator",
    "to": ["agent.calculator.calculation"],
    "intent": "calculate",
    "task": "Calculate 5 + 3",
    "payload": {"a": 5, "b": 3, "op": "+"},
    "context": {"customer_id": "customer-123", "session_id": "session-456"},
    "correlation": {"conversation_id": "conv-789", "reply_to": "msg-uuid-000"},
    "expected": {"type": "inform", "timeout": 5000},
    "status": {"state": "pending", "progress": 0.0},
    "security": {"token": "jwt-token-here", "permissions": ["calculate"]},
}


def _tap(console_port: int, lines: queue.Queue[dict[str, Any]], opened: threading.Event) -> None:
    """Follows the console's live traffic to the calculator (server-sent events) into ``lines``
    for WAIT seconds. (Not all traffic: a tap on every subject is a subscriber of every
    subject, so a request to an agent nobody serves would time out instead of failing fast.)"""
    req = urllib.request.Request(
        f"http://127.0.0.1:{console_port}/tap/events?pattern=agent.calculator.%3E", headers={"X-API-Key": API_KEY}
    )
    deadline = time.monotonic() + WAIT
    try:
        with urllib.request.urlopen(req, timeout=WAIT) as stream:
            opened.set()
            for raw in stream:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    lines.put(json.loads(line[5:]))
                if time.monotonic() > deadline:
                    return
    except (OSError, ValueError):
        opened.set()


async def _frame(ws: Any) -> dict[str, Any]:
    return dict(json.loads(await asyncio.wait_for(ws.recv(), WAIT)))


async def test_agentify_frames_over_the_websocket_reach_a_calculator_and_its_task_is_shown(
    server: Any, tmp_path: Path
) -> None:
    import websockets

    tasks_seen: list[Any] = []
    console_port = _free_port()
    console = f'[gateway.console]\nlisten = "127.0.0.1:{console_port}"\n'
    with gateway(server, tmp_path, "app", console) as port:
        async with py_agent(server, "calculator", heartbeat_interval=0.2) as calculator:

            @calculator.capability("calculation")
            @calculator.command("calculation")
            async def calculation(ctx: Context) -> Any:
                tasks_seen.append((ctx.headers.get("agentify-task"), ctx.envelope.customer_id, ctx.envelope.session_id))
                p = ctx.data()
                if p["op"] == "/" and p["b"] == 0:
                    raise ChorusError(StatusCode.INVALID_ARGUMENT, "Division by zero")
                return {"result": {"+": p["a"] + p["b"], "/": p["a"] / max(p["b"], 1)}[p["op"]]}

            await calculator.flush()
            lines: queue.Queue[dict[str, Any]] = queue.Queue()
            opened = threading.Event()
            threading.Thread(target=_tap, args=(console_port, lines, opened), daemon=True).start()
            assert await asyncio.to_thread(opened.wait, WAIT)

            url = f"ws://127.0.0.1:{port}/agent/ws"
            async with websockets.connect(url, additional_headers={"X-API-Key": API_KEY}) as ws:
                # The seed's request frame, as written: its inform frame comes back.
                await ws.send(SEED_WS_REQUEST)
                inform = await _frame(ws)
                assert inform["type"] == "inform"
                assert inform["sender"] == "agent.calculator"
                assert inform["to"] == ["agent.app.orchestrator"]
                assert inform["intent"] == "result"
                assert inform["payload"] == {"result": 8}

                # The base message: task, context and expectation carried, the answer correlated.
                await ws.send(json.dumps(SEED_BASE_MESSAGE))
                inform = await _frame(ws)
                assert (inform["type"], inform["payload"]) == ("inform", {"result": 8})
                assert inform["correlation"] == {"conversation_id": "conv-789", "reply_to": "msg-uuid-123"}
                assert tasks_seen[-1] == ("Calculate 5 + 3", "customer-123", "session-456")

                # A failure comes back as Agentify's failure, with the code and the reason.
                divide = dict(SEED_BASE_MESSAGE, id="msg-div", payload={"a": 5, "b": 0, "op": "/"})
                await ws.send(json.dumps(divide))
                failure = await _frame(ws)
                assert (failure["type"], failure["intent"]) == ("failure", "invalid_argument")
                assert failure["payload"]["error"] == "Division by zero" and failure["payload"]["code"] == 5018
                assert failure["correlation"]["reply_to"] == "msg-div"
                # So does an agent nobody serves, and a sender other than the caller is refused.
                await ws.send(json.dumps(dict(SEED_BASE_MESSAGE, id="q2", to=["agent.nobody.calculation"])))
                failure = await _frame(ws)
                assert (failure["type"], failure["payload"]["code"], failure["correlation"]["reply_to"]) == ("failure", 5012, "q2")
                await ws.send(json.dumps(dict(SEED_BASE_MESSAGE, id="q3", sender="agent.intruder")))
                refuse = await _frame(ws)
                assert (refuse["type"], refuse["intent"], refuse["correlation"]["reply_to"]) == ("refuse", "permission_denied", "q3")
                await ws.send("not json")
                assert (await _frame(ws))["payload"]["code"] == 5006

                # Flow 2's discover, as the seed writes it: an offer names the calculator (it
                # serves every customer, so customer-123's discover finds it).
                deadline = time.monotonic() + WAIT
                while True:
                    await ws.send(json.dumps(SEED_DISCOVER))
                    offer = await _frame(ws)
                    assert (offer["type"], offer["to"]) == ("offer", ["agent.app"]), offer
                    found = {a["agent_id"]: a for a in offer["payload"]["agents"]}
                    if "calculator" in found:
                        break
                    assert time.monotonic() < deadline, f"the calculator was never offered: {offer}"
                    await asyncio.sleep(0.1)
                assert [c["name"] for c in found["calculator"]["capabilities"]] == ["calculation"]

                # A request to the identity is pushed as an Agentify request; an inform answers it.
                asked = asyncio.create_task(calculator.request("app", "approve", {"amount": 3}, timeout=WAIT))
                pushed = await _frame(ws)
                assert (pushed["type"], pushed["sender"], pushed["to"]) == ("request", "agent.calculator", ["agent.app"])
                assert (pushed["intent"], pushed["payload"]) == ("approve", {"amount": 3})
                await ws.send(json.dumps({
                    "type": "inform", "sender": "agent.app.orchestrator", "to": [pushed["sender"]],
                    "intent": "result", "payload": {"approved": True}, "correlation": {"reply_to": pushed["id"]},
                }))
                assert await asyncio.wait_for(asked, WAIT) == {"approved": True}

            # The console's live traffic shows the task beside the request that carried it.
            deadline = time.monotonic() + WAIT
            while True:
                try:
                    line = await asyncio.to_thread(lines.get, True, max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    raise AssertionError(f"the console's tap showed no task within {WAIT} s") from None
                if line.get("task") == "Calculate 5 + 3":
                    assert (line["from"], line["to"], line["name"]) == ("app", ["calculator"], "calculation")
                    break
