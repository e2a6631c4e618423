"""The gateway's A2A 1.0 binding, driven by the official Python client (a2a-sdk) against a
Rust agent on the bus: a blocking task completed, a streamed one followed through progress
and chunks to its result, a question answered, a running task cancelled."""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_gateway import API_KEY, WAIT, gateway

a2a = pytest.importorskip("a2a", reason="a2a-sdk is installed by scripts/install-python-sdk")


async def _client(base: str, streaming: bool) -> Any:
    from a2a.client import ClientConfig, create_client

    http = httpx.AsyncClient(headers={"X-API-Key": API_KEY}, timeout=WAIT)
    return await create_client(base, client_config=ClientConfig(streaming=streaming, httpx_client=http))


def _request(text: str, task_id: str | None = None, **configuration: Any) -> Any:
    from a2a.helpers import new_text_message
    from a2a.types import Role, SendMessageConfiguration, SendMessageRequest

    message = new_text_message(text, role=Role.ROLE_USER)
    if task_id is not None:
        message.task_id = task_id
    return SendMessageRequest(message=message, configuration=SendMessageConfiguration(**configuration))


async def _until_card(base: str) -> None:
    """The card answers once the Rust agent has registered."""
    async with httpx.AsyncClient(headers={"X-API-Key": API_KEY}) as http:
        async with asyncio.timeout(WAIT):
            while (await http.get(f"{base}/.well-known/agent-card.json")).status_code != 200:
                await asyncio.sleep(0.1)


async def test_the_a2a_sdk_client_runs_streams_answers_and_cancels_tasks_of_a_rust_agent(
    server: Any, rust_peer: Any, tmp_path: Path
) -> None:
    from a2a.helpers import get_artifact_text
    from a2a.types import CancelTaskRequest, GetTaskRequest, TaskNotFoundError, TaskState

    rust_peer()
    with gateway(server, tmp_path, "a2a-user") as port:
        agents = f"http://127.0.0.1:{port}/a2a/agents/rust-peer"
        await _until_card(f"{agents}/draft")
        async with asyncio.timeout(60):
            # Blocking: the answer is the completed task with its result.
            async with await _client(f"{agents}/draft", streaming=False) as client:
                [answer] = [r async for r in client.send_message(_request("gateways"))]
                task = answer.task
                assert task.status.state == TaskState.TASK_STATE_COMPLETED, task
                # Issue 33, item 4: what the task streamed is there for a blocking client too,
                # as its own artifact, in order, before the result.
                assert [a.name for a in task.artifacts] == ["stream", "result"], task.artifacts
                streamed = [p.text for p in task.artifacts[0].parts]
                assert streamed == ["a", "short", "draft", "about", "gateways"], streamed
                assert get_artifact_text(task.artifacts[1]) == "a short draft about gateways"
                fetched = await client.get_task(GetTaskRequest(id=task.id))
                assert fetched.status.state == TaskState.TASK_STATE_COMPLETED
                with pytest.raises(TaskNotFoundError):
                    await client.get_task(GetTaskRequest(id="01234567-89ab-7def-8123-456789abcdef"))

            # Streaming: progress, the chunks appended to one artifact, the result, completed.
            async with await _client(f"{agents}/draft", streaming=True) as client:
                kinds, states, chunks, result, stamps = [], [], [], None, []
                async for event in client.send_message(_request("streams")):
                    kind = event.WhichOneof("payload")
                    kinds.append(kind)
                    if kind == "task":
                        stamps.append(event.task.status.timestamp.ToDatetime())
                    if kind == "status_update":
                        states.append(TaskState.Name(event.status_update.status.state))
                        stamps.append(event.status_update.status.timestamp.ToDatetime())
                    elif kind == "artifact_update":
                        artifact = event.artifact_update.artifact
                        if artifact.name == "stream":
                            chunks.append(get_artifact_text(artifact))
                        else:
                            result = get_artifact_text(artifact)
                assert kinds[0] == "task", kinds
                assert "TASK_STATE_WORKING" in states and states[-1] == "TASK_STATE_COMPLETED", states
                assert " ".join(chunks) == "a short draft about streams", chunks
                # Issue 33, item 9: a stream's timestamps never run backwards.
                assert stamps == sorted(stamps), stamps
                assert result == "a short draft about streams"

            # A question: the task stops at input-required; the answer continues it.
            async with await _client(f"{agents}/question", streaming=False) as client:
                [asked] = [r async for r in client.send_message(_request("paint"))]
                assert asked.task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED, asked.task
                assert "which colour?" in asked.task.status.message.parts[0].text
                [answered] = [r async for r in client.send_message(_request("blue", task_id=asked.task.id))]
                assert answered.task.status.state == TaskState.TASK_STATE_COMPLETED, answered.task
                assert get_artifact_text(answered.task.artifacts[-1]) == "painted blue"

            # Cancel a task that runs until cancelled.
            async with await _client(f"{agents}/slow", streaming=False) as client:
                [started] = [r async for r in client.send_message(_request("wait", return_immediately=True))]
                assert started.task.status.state in (TaskState.TASK_STATE_SUBMITTED, TaskState.TASK_STATE_WORKING)
                cancelled = await client.cancel_task(CancelTaskRequest(id=started.task.id))
                assert cancelled.status.state == TaskState.TASK_STATE_CANCELED, cancelled


async def test_the_card_says_how_to_authenticate_and_can_be_read_without_credentials(
    server: Any, rust_peer: Any, tmp_path: Path
) -> None:
    """Issue 33, item 3: the card declares the schemes the gateway enforces (an API key in
    X-API-Key, a bearer JWT), parsed by the official client's card resolver; with
    `public_cards` it is served without credentials, and a call without them is still 401."""
    from a2a.client import A2ACardResolver

    rust_peer()
    secret = tmp_path / "hs256.secret"
    secret.write_text("a-shared-hs256-secret-of-at-least-32-bytes\n")
    extra = (
        "public_cards = true\n"
        '[gateway.jwt]\nissuer = "https://auth.example.test"\naudience = "chorus-gateway"\n'
        f'hs256_secret_file = "{secret}"\n'
    )
    with gateway(server, tmp_path, "a2a-card", extra) as port:
        base = f"http://127.0.0.1:{port}/a2a/agents/rust-peer/draft"
        await _until_card(base)
        async with httpx.AsyncClient(timeout=WAIT) as anonymous:
            card = await A2ACardResolver(httpx_client=anonymous, base_url=base).get_agent_card()
            key = card.security_schemes["apiKey"].api_key_security_scheme
            assert (key.location, key.name) == ("header", "X-API-Key")
            bearer = card.security_schemes["bearer"].http_auth_security_scheme
            assert (bearer.scheme, bearer.bearer_format) == ("Bearer", "JWT")
            alternatives = [sorted(r.schemes.keys()) for r in card.security_requirements]
            assert alternatives == [["apiKey"], ["bearer"]], alternatives
            assert card.supported_interfaces[0].url == f"{base}/"
            # The card is public; the agent is not.
            call = await anonymous.post(f"{base}/", json={"jsonrpc": "2.0", "id": 1, "method": "GetTask",
                                                          "params": {"id": "x"}})
            assert call.status_code == 401, call.text


async def test_the_gateways_own_well_known_card_is_the_default_agents(
    server: Any, rust_peer: Any, tmp_path: Path
) -> None:
    """Issue 33, item 10: with `a2a_default`, the gateway's root `/.well-known/agent-card.json`
    (the spec's well-known URI) is that agent's card, read by the official resolver from the
    gateway's bare address; without it, that URI is 404."""
    from a2a.client import A2ACardResolver

    rust_peer()
    with gateway(server, tmp_path, "a2a-root", 'a2a_default = "agents/rust-peer/draft"\n') as port:
        root = f"http://127.0.0.1:{port}"
        await _until_card(f"{root}/a2a/agents/rust-peer/draft")
        async with httpx.AsyncClient(headers={"X-API-Key": API_KEY}, timeout=WAIT) as http:
            card = await A2ACardResolver(httpx_client=http, base_url=root).get_agent_card()
            assert card.name == "rust-peer draft", card
            assert card.supported_interfaces[0].url == f"{root}/a2a/agents/rust-peer/draft/"
    with gateway(server, tmp_path, "a2a-noroot") as port:
        async with httpx.AsyncClient(headers={"X-API-Key": API_KEY}, timeout=WAIT) as http:
            missing = await http.get(f"http://127.0.0.1:{port}/.well-known/agent-card.json")
            assert missing.status_code == 404, missing.text


async def test_a_plain_command_offered_as_an_a2a_agent_completes_with_its_reply(
    server: Any, rust_peer: Any, tmp_path: Path
) -> None:
    """Issue 33, item 7: a command that is not a task handler (the Rust peer's `echo`),
    offered as an A2A agent, answers a blocking send at once: the task completes with the
    command's reply as its result, instead of staying submitted until the client gives up."""
    from a2a.helpers import get_artifact_text
    from a2a.types import GetTaskRequest, TaskState

    rust_peer()
    with gateway(server, tmp_path, "a2a-plain") as port:
        base = f"http://127.0.0.1:{port}/a2a/agents/rust-peer/echo"
        await _until_card(base)

        async def send() -> Any:
            async with await _client(base, streaming=False) as client:
                [answer] = [r async for r in client.send_message(_request("plain words"))]
                fetched = await client.get_task(GetTaskRequest(id=answer.task.id))
                return answer.task, fetched

        task, fetched = await asyncio.wait_for(send(), 15)
        assert task.status.state == TaskState.TASK_STATE_COMPLETED, task
        assert get_artifact_text(task.artifacts[-1]) == "plain words", task.artifacts
        assert fetched.status.state == TaskState.TASK_STATE_COMPLETED


async def _rpc(http: httpx.AsyncClient, url: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """One raw JSON-RPC call (for what the client cannot express), its whole response."""
    r = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _message(text: str, **fields: Any) -> dict[str, Any]:
    import uuid

    return {"messageId": str(uuid.uuid4()), "role": "ROLE_USER", "parts": [{"text": text}], **fields}


async def test_a_json_result_reads_as_text_and_a_context_groups_tasks_with_their_history(
    server: Any, rust_peer: Any, tmp_path: Path
) -> None:
    """Issue 33, items 5 and 8: a JSON result has a text part beside its data part (the
    official client's text helper reads it); a client's contextId is kept, a follow-up in it
    is a new task of the same context, and GetTask returns the history, cut by historyLength."""
    import json

    from a2a.helpers import get_artifact_text
    from a2a.types import GetTaskRequest, Part, TaskState
    from google.protobuf import struct_pb2

    rust_peer()
    with gateway(server, tmp_path, "a2a-context") as port:
        base = f"http://127.0.0.1:{port}/a2a/agents/rust-peer/echo"
        await _until_card(base)
        async with asyncio.timeout(30), await _client(base, streaming=False) as client:
            # A data part in, the same JSON out: as data, and as text beside it.
            request = _request("unused")
            value = struct_pb2.Value()
            value.struct_value.update({"n": 3, "words": ["a", "b"]})
            del request.message.parts[:]
            request.message.parts.append(Part(data=value))
            request.message.context_id = "conversation-7"
            [answer] = [r async for r in client.send_message(request)]
            task = answer.task
            assert task.status.state == TaskState.TASK_STATE_COMPLETED, task
            assert json.loads(get_artifact_text(task.artifacts[-1])) == {"n": 3, "words": ["a", "b"]}
            assert task.context_id == "conversation-7", task

            # A follow-up in the same context: a new task there.
            follow = _request("and again")
            follow.message.context_id = "conversation-7"
            [again] = [r async for r in client.send_message(follow)]
            assert again.task.context_id == "conversation-7"
            assert again.task.id != task.id

            # History: the user's message (its own messageId), whole or cut.
            fetched = await client.get_task(GetTaskRequest(id=again.task.id))
            users = [m for m in fetched.history if m.role == 1]
            assert [m.message_id for m in users] == [follow.message.message_id], fetched.history
            short = await client.get_task(GetTaskRequest(id=again.task.id, history_length=0))
            assert len(short.history) == 0

        # A contextId that is not the task's is refused.
        async with httpx.AsyncClient(headers={"X-API-Key": API_KEY, "A2A-Version": "1.0"}, timeout=WAIT) as http:
            wrong = await _rpc(http, f"{base}/", "SendMessage",
                               {"message": _message("x", taskId=task.id, contextId="another")})
            assert wrong["error"]["code"] == -32602, wrong


async def test_list_tasks_pages_through_every_task_and_filters_on_the_server(
    server: Any, rust_peer: Any, tmp_path: Path
) -> None:
    """Issue 33, item 6: ListTasks pages through every task (420 of them, past the ~400 the
    old listing could see), newest first, each once, with nextPageToken and the true
    totalSize; filters on context and state run on the server; 50 by default, no artifacts
    unless asked; bad parameters are -32602."""
    rust_peer()
    # Past the default rate of 100 requests a second: 420 sends come faster than that.
    with gateway(server, tmp_path, "a2a-list", "rate_per_second = 5000.0\nrate_burst = 500.0\n") as port:
        echo = f"http://127.0.0.1:{port}/a2a/agents/rust-peer/echo/"
        question = f"http://127.0.0.1:{port}/a2a/agents/rust-peer/question/"
        await _until_card(echo.rstrip("/"))
        headers = {"X-API-Key": API_KEY, "A2A-Version": "1.0"}
        async with httpx.AsyncClient(headers=headers, timeout=WAIT) as http, asyncio.timeout(240):
            limit = asyncio.Semaphore(8)

            async def send(url: str, text: str, context: str) -> str:
                async with limit:
                    r = await _rpc(http, url, "SendMessage", {"message": _message(text, contextId=context)})
                    assert "result" in r, r
                    task_id: str = r["result"]["task"]["id"]
                    return task_id

            many = await asyncio.gather(*(send(echo, f"n{i}", "bulk") for i in range(420)))
            asked = await asyncio.gather(*(send(question, "paint", "asking") for _ in range(3)))

            seen: list[str] = []
            stamps: list[datetime] = []
            token = ""
            pages = 0
            while True:
                params: dict[str, Any] = {"contextId": "bulk", "pageSize": 100}
                if token:
                    params["pageToken"] = token
                r = (await _rpc(http, echo, "ListTasks", params))["result"]
                pages += 1
                assert r["totalSize"] == 420, r["totalSize"]
                assert r["pageSize"] == len(r["tasks"])
                seen += [t["id"] for t in r["tasks"]]
                stamps += [datetime.fromisoformat(t["status"]["timestamp"]) for t in r["tasks"]]
                assert all("artifacts" not in t for t in r["tasks"])
                token = r["nextPageToken"]
                if not token:
                    break
            assert pages == 5
            assert sorted(seen) == sorted(many) and len(set(seen)) == 420
            # Newest first (by the last change of state), across pages.
            assert stamps == sorted(stamps, reverse=True)

            default = (await _rpc(http, echo, "ListTasks", {}))["result"]
            assert len(default["tasks"]) == 50 and default["totalSize"] == 420
            # A state filter: the questions wait for input; the echoes do not.
            waiting = (await _rpc(http, question, "ListTasks", {"status": "TASK_STATE_INPUT_REQUIRED"}))["result"]
            assert sorted(t["id"] for t in waiting["tasks"]) == sorted(asked)
            none = (await _rpc(http, echo, "ListTasks", {"status": "TASK_STATE_INPUT_REQUIRED"}))["result"]
            assert none["tasks"] == [] and none["totalSize"] == 0
            with_artifacts = (await _rpc(http, echo, "ListTasks", {"pageSize": 1, "includeArtifacts": True}))["result"]
            assert with_artifacts["tasks"][0]["artifacts"], with_artifacts

            for bad in ({"pageSize": 0}, {"pageSize": -1}, {"pageSize": 101}, {"pageToken": "x"},
                        {"statusTimestampAfter": "yesterday"}, {"historyLength": -1}, {"status": "DONE"}):
                refused = await _rpc(http, echo, "ListTasks", bad)
                assert refused.get("error", {}).get("code") == -32602, (bad, refused)


async def test_the_rest_binding_serves_the_official_client_as_json_rpc_does(
    server: Any, rust_peer: Any, tmp_path: Path
) -> None:
    """Issue 33, item 11: the card lists HTTP+JSON beside JSON-RPC, and the official client,
    told to prefer HTTP+JSON, sends, streams, gets, lists and cancels over it; a task that is
    not there is the SDK's TaskNotFoundError; errors are problem details (RFC 9457)."""
    from a2a.client import ClientConfig, create_client
    from a2a.helpers import get_artifact_text
    from a2a.types import CancelTaskRequest, GetTaskRequest, ListTasksRequest, TaskNotFoundError, TaskState

    rust_peer()
    with gateway(server, tmp_path, "a2a-rest") as port:
        base = f"http://127.0.0.1:{port}/a2a/agents/rust-peer"
        await _until_card(f"{base}/draft")
        async with httpx.AsyncClient(headers={"X-API-Key": API_KEY}, timeout=WAIT) as http:
            card = (await http.get(f"{base}/draft/.well-known/agent-card.json")).json()
            bindings = {i["protocolBinding"]: i["url"] for i in card["supportedInterfaces"]}
            assert bindings == {"JSONRPC": f"{base}/draft/", "HTTP+JSON": f"{base}/draft"}, bindings

            async def client(command: str, streaming: bool) -> Any:
                config = ClientConfig(streaming=streaming, httpx_client=http,
                                      supported_protocol_bindings=["HTTP+JSON"], use_client_preference=True)
                return await create_client(f"{base}/{command}", client_config=config)

            async with asyncio.timeout(60):
                rest = await client("draft", streaming=False)
                [answer] = [r async for r in rest.send_message(_request("rest"))]
                task = answer.task
                assert task.status.state == TaskState.TASK_STATE_COMPLETED, task
                assert get_artifact_text(task.artifacts[-1]) == "a short draft about rest"
                fetched = await rest.get_task(GetTaskRequest(id=task.id, history_length=1))
                assert fetched.id == task.id and len(fetched.history) == 1
                listed = await rest.list_tasks(ListTasksRequest(page_size=10))
                assert [t.id for t in listed.tasks] == [task.id] and listed.total_size == 1
                with pytest.raises(TaskNotFoundError):
                    await rest.get_task(GetTaskRequest(id="01234567-89ab-7def-8123-456789abcdef"))

                streaming = await client("draft", streaming=True)
                kinds = [e.WhichOneof("payload") async for e in streaming.send_message(_request("streams"))]
                assert kinds[0] == "task" and "artifact_update" in kinds and kinds[-1] == "status_update", kinds

                slow = await client("slow", streaming=False)
                [started] = [r async for r in slow.send_message(_request("wait", return_immediately=True))]
                cancelled = await slow.cancel_task(CancelTaskRequest(id=started.task.id))
                assert cancelled.status.state == TaskState.TASK_STATE_CANCELED, cancelled

        # Below the client (which set its own headers on the one above): the version header is
        # required, and errors are problem details.
        async with httpx.AsyncClient(headers={"X-API-Key": API_KEY}, timeout=WAIT) as http:
            old = await http.get(f"{base}/draft/tasks/{task.id}")
            assert old.status_code == 400 and old.headers["content-type"] == "application/problem+json"
            assert old.json()["type"] == "https://a2a-protocol.org/errors/version-not-supported", old.text
            finished = await http.post(f"{base}/draft/tasks/{task.id}:cancel", headers={"A2A-Version": "1.0"}, json={})
            assert finished.status_code == 409, finished.text
            bad = await http.get(f"{base}/draft/tasks", params={"pageSize": "0"}, headers={"A2A-Version": "1.0"})
            assert bad.status_code == 400 and "pageSize" in bad.json()["detail"], bad.text
