"""Tasks at parity with the Rust SDK, across languages: verified results (a function, a JSON
Schema, a supervisor agent) retried, reassigned between Python and Rust workers and escalated to
a supervisor, with the same states, attempts, verdicts and final codes on both sides; the JSON
Schemas both SDKs accept and refuse; and a handoff from a Python worker to a Rust one and back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from chorus_sdk import (
    Agent,
    ChorusError,
    Envelope,
    Kind,
    Performative,
    Schema,
    SchemaError,
    StatusCode,
    TaskContext,
    TaskReport,
    TaskState,
    Verification,
)
from chorus_sdk.envelope import Expect

from .conftest import py_agent

WAIT = 20.0
GOOD = "a summary long enough to pass"
SUMMARY = {
    "type": "object",
    "required": ["summary"],
    "properties": {"summary": {"type": "string", "minLength": 10}},
}


def summarizer(agent: Agent, summary: str) -> None:
    """Serves the task ``summarize`` on ``agent``, answering ``{"summary": summary}``."""

    @agent.task("summarize")
    async def summarize(task: TaskContext) -> dict[str, str]:
        return {"summary": summary}


def turns(report: TaskReport) -> list[tuple[str, bool | None]]:
    return [(a.agent, a.verified) for a in report.attempts]


def as_json(report: TaskReport) -> dict[str, Any]:
    """A Python report in the form the Rust peer's ``report`` command gives one."""
    return {
        "id": str(report.id),
        "state": report.state.value,
        "status": report.status,
        "reason": report.reason,
        "requester": report.requester,
        "target": report.target,
        "output": report.data() if report.is_completed else None,
        "attempts": [
            {
                "agent": a.agent,
                "state": a.state.value,
                "status": a.status,
                "verified": a.verified,
                "note": a.note,
                "started_ms": a.started_ms,
                "ended_ms": a.ended_ms,
            }
            for a in report.attempts
        ],
        "submitted_ms": report.submitted_ms,
        "finished_ms": report.finished_ms,
        "last_seq": report.last_seq,
    }


async def rust_report(py: Agent, peer: Any, task: Any) -> dict[str, Any]:
    report: dict[str, Any] = await py.request(peer.id, "report", str(task), timeout=WAIT)
    return report


async def updates_of(py: Agent, task: Any) -> list[Any]:
    """Every message of the task, to its end, within the test's deadline."""

    async def read() -> list[Any]:
        return [u async for u in py.task_handle(task).updates()]

    return await asyncio.wait_for(read(), WAIT)


async def states_by(py: Agent, task: Any) -> list[tuple[TaskState, str]]:
    return [(u.state, u.envelope.from_) for u in await updates_of(py, task) if u.state is not None]


SCHEMA_CASES: list[tuple[Any, list[Any]]] = [
    (SUMMARY, [{"summary": "short"}, {"summary": GOOD}, {}, [], {"summary": 3}]),
    ({"type": "integer", "minimum": 3}, [2, 3, 3.5, "x", None]),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "items": [{"type": "string"}], "additionalItems": False}, [["a", 1], ["a"], [1]]),
    ({"prefixItems": [{"type": "string"}], "items": False}, [["a", 1], ["a"]]),
    ({"pattern": "^a+$"}, ["aaa", "b", 3]),
    ({"format": "email"}, ["not an email", "a@b.example"]),
    ({"enum": [1, "a", None]}, [2, "a", None]),
    ({"type": "object", "additionalProperties": False, "properties": {"a/b": {"type": "string"}}}, [{"a/b": 1, "c": 2}, {"a/b": "x"}]),
    ({"$defs": {"pos": {"type": "integer", "exclusiveMinimum": 0}}, "type": "array", "items": {"$ref": "#/$defs/pos"}}, [[1, 0, -1], [2]]),
    ({"uniqueItems": True, "maxItems": 2}, [[1, 1.0], [1, 2, 3]]),
    ({"const": {"a": [1, 2]}}, [{"a": [1, 2]}, {"a": [2, 1]}]),
    (True, [1]),
    (False, [1]),
    ({"type": 12}, [1]),
    ({"required": "a"}, [1]),
    ({"minLength": -1}, [1]),
    ({"pattern": "("}, [1]),
    ({"$ref": "http://example.com/schema.json"}, [1]),
    ({"$ref": "#/$defs/missing"}, [1]),
]


async def test_both_sdks_accept_and_refuse_the_same_schemas_and_values(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-schemas")
    async with py_agent(server, "py-schemas") as py:
        for schema, values in SCHEMA_CASES:
            for value in values:
                rust = await py.request(peer.id, "schema_check", {"schema": schema, "value": value}, timeout=WAIT)
                try:
                    compiled = Schema.compile(schema)
                except SchemaError as e:
                    assert not rust["compiles"], f"Rust compiles {schema!r}; Python: {e}"
                    assert str(e).startswith("the JSON Schema does not compile: ")
                    continue
                assert rust["compiles"], f"Python compiles {schema!r}; Rust: {rust.get('error')}"
                assert compiled.errors(value, 10) == rust["errors"], (schema, value)
                assert compiled.is_valid(value) == (not rust["errors"])
    with pytest.raises(SchemaError):
        Verification.schema({"type": "nonsense"})


async def test_a_python_result_failing_the_schema_is_reassigned_to_a_rust_worker(server: Any, rust_peer: Any) -> None:
    careful = rust_peer("rust-careful")
    async with py_agent(server, "py-sloppy") as sloppy, py_agent(server, "py-boss") as py:
        summarizer(sloppy, "short")
        await sloppy.flush()
        handle = await py.submit("a long document", to=sloppy.id, name="summarize", verify=True)
        verification = Verification.schema(SUMMARY, candidates=[careful.id])
        report = await asyncio.wait_for(py.verify(handle, verification), WAIT)
        assert (report.state, report.status, report.worker) == (TaskState.COMPLETED, StatusCode.OK, careful.id)
        assert report.data() == {"summary": GOOD}
        assert turns(report) == [(sloppy.id, False), (careful.id, True)]
        note = report.attempts[0].note or ""
        assert note.startswith('does not meet the schema: /summary: "short" is shorter than 10 characters'), note
        assert note.endswith(f"; reassigned to {careful.id}"), note
        # Each attempt ended with the result it reported; the verdict is apart.
        assert [(a.state, a.status) for a in report.attempts] == [(TaskState.COMPLETED, 5002)] * 2
        assert await states_by(py, handle.id) == [
            (TaskState.SUBMITTED, py.id),
            (TaskState.ACCEPTED, sloppy.id),
            (TaskState.WORKING, sloppy.id),
            (TaskState.SUBMITTED, py.id),
            (TaskState.ACCEPTED, careful.id),
            (TaskState.WORKING, careful.id),
            (TaskState.COMPLETED, py.id),
        ]
        # The Rust SDK folds the same messages into the same report; so do the handle's.
        assert await rust_report(py, careful, handle.id) == as_json(report)
        assert as_json(await asyncio.wait_for(handle.report(), WAIT)) == as_json(report)
        assert as_json(await handle.result(timeout=WAIT)) == as_json(report)


async def test_a_rust_result_refused_by_a_rust_supervisor_is_reassigned_to_a_python_worker(
    server: Any, rust_peer: Any
) -> None:
    terse = rust_peer("rust-terse", PEER_SUMMARY="short")
    async with py_agent(server, "py-careful") as careful, py_agent(server, "py-boss-2") as py:
        summarizer(careful, GOOD)
        await careful.flush()
        handle = await py.submit("a long document", to=terse.id, name="summarize", verify=True)
        # The Rust peer's `judge` is the supervisor agent that checks each result.
        verification = Verification.agent(terse.id, "judge", candidates=[careful.id])
        report = await asyncio.wait_for(py.verify(handle, verification), WAIT)
        assert (report.state, report.status, report.worker) == (TaskState.COMPLETED, StatusCode.OK, careful.id)
        assert report.data() == {"summary": GOOD}
        assert turns(report) == [(terse.id, False), (careful.id, True)]
        assert report.attempts[0].note == f'summary "short" is too short; reassigned to {careful.id}'
        assert await rust_report(py, terse, handle.id) == as_json(report)

        # A supervisor that is not there is no verdict: the error, and the task stays working.
        lost = await py.submit("a long document", to=terse.id, name="summarize", verify=True)
        with pytest.raises(ChorusError) as nobody:
            await asyncio.wait_for(py.verify(lost, Verification.agent("nobody-here", "judge")), WAIT)
        assert nobody.value.status == StatusCode.NO_RESPONDERS
        assert await asyncio.wait_for(lost.state(), WAIT) is TaskState.WORKING


async def test_a_rust_requester_reassigns_between_python_and_rust_workers(server: Any, rust_peer: Any) -> None:
    boss = rust_peer("rust-boss")
    good = rust_peer("rust-good")
    terse = rust_peer("rust-terse-2", PEER_SUMMARY="short")
    async with py_agent(server, "py-sloppy-3") as sloppy, py_agent(server, "py-careful-3") as careful:
        summarizer(sloppy, "short")
        summarizer(careful, GOOD)
        await sloppy.flush()
        await careful.flush()
        # A Python worker's result fails the Rust requester's schema: reassigned to Rust.
        order = {"to": sloppy.id, "name": "summarize", "payload": "doc", "schema": SUMMARY, "candidates": [good.id]}
        seen = await careful.request(boss.id, "verified", order, timeout=WAIT)
        assert (seen["state"], seen["status"], seen["output"]) == ("completed", 5002, {"summary": GOOD})
        assert [(a["agent"], a["verified"]) for a in seen["attempts"]] == [(sloppy.id, False), (good.id, True)]
        assert "does not meet the schema" in seen["attempts"][0]["note"]
        # The Python SDK reads the same report from the task stream.
        report = await asyncio.wait_for(careful.task_handle(seen["id"]).report(), WAIT)
        assert as_json(report) == seen

        # A Rust worker's result fails the Rust judge: reassigned to the Python worker.
        order = {"to": terse.id, "name": "summarize", "judge": {"agent": boss.id, "command": "judge"}, "candidates": [careful.id]}
        seen = await careful.request(boss.id, "verified", order, timeout=WAIT)
        assert (seen["state"], seen["output"]) == ("completed", {"summary": GOOD})
        assert [(a["agent"], a["verified"]) for a in seen["attempts"]] == [(terse.id, False), (careful.id, True)]
        assert as_json(await asyncio.wait_for(careful.task_handle(seen["id"]).report(), WAIT)) == seen

        # Retried once on the Python worker, then the Rust one, then out of attempts: 5025.
        order = {
            "to": sloppy.id, "name": "summarize", "schema": SUMMARY,
            "retries": 1, "candidates": [terse.id], "max_attempts": 3,
        }
        seen = await careful.request(boss.id, "verified", order, timeout=WAIT)
        assert (seen["state"], seen["status"]) == ("failed", StatusCode.UNVERIFIED)
        assert [a["agent"] for a in seen["attempts"]] == [sloppy.id, sloppy.id, terse.id]
        assert seen["reason"].startswith("no result passed verification in 3 attempts: attempt 1 by py-sloppy-3")


async def test_python_escalates_a_failing_task_to_a_supervisor(server: Any, rust_peer: Any) -> None:
    terse = rust_peer("rust-terse-4", PEER_SUMMARY="short")
    async with py_agent(server, "py-editor") as editor, py_agent(server, "py-boss-4") as py:
        summarizer(editor, GOOD)
        await editor.flush()
        # Nobody to reassign to (a task for one agent, no candidates): the supervisor gets it.
        handle = await py.submit("doc", to=terse.id, name="summarize", verify=True)
        report = await asyncio.wait_for(py.verify(handle, Verification.schema(SUMMARY, escalate_to=editor.id)), WAIT)
        assert (report.state, report.worker) == (TaskState.COMPLETED, editor.id)
        assert turns(report) == [(terse.id, False), (editor.id, True)]
        assert (report.attempts[0].note or "").endswith(f"; reassigned to {editor.id}")
        updates = await updates_of(py, handle.id)
        again = [u.envelope for u in updates if u.state is TaskState.SUBMITTED][1]
        assert (again.to, again.from_) == ([editor.id], py.id)
        assert await rust_report(py, terse, handle.id) == as_json(report)

        # The supervisor is tried after the candidates, and a supervisor that fails too ends
        # the task with 5025 and the chain of verdicts.
        handle = await py.submit("doc", to=terse.id, name="summarize", verify=True)
        strict = Verification.schema({"const": "never"}, candidates=[editor.id, terse.id], escalate_to=terse.id, max_attempts=5)
        report = await asyncio.wait_for(py.verify(handle, strict), WAIT)
        assert (report.state, report.status) == (TaskState.FAILED, StatusCode.UNVERIFIED)
        # terse failed (a candidate that failed, and the supervisor, are not tried again).
        assert [a.agent for a in report.attempts] == [terse.id, editor.id]
        assert report.reason is not None and "in 2 attempts" in report.reason
        # As in the Rust SDK: a verdict is recorded when the task moves on from an attempt; the
        # last one's is the task's own end.
        assert turns(report) == [(terse.id, False), (editor.id, None)]
        assert report.reason.endswith("attempt 2 by py-editor: does not meet the schema: \"never\" was expected")
        assert await rust_report(py, terse, handle.id) == as_json(report)


async def test_rust_escalates_a_python_failure_to_a_supervisor(server: Any, rust_peer: Any) -> None:
    boss = rust_peer("rust-boss-5")
    supervisor = rust_peer("rust-supervisor")
    async with py_agent(server, "py-sloppy-5") as sloppy, py_agent(server, "py-editor-5") as editor:
        summarizer(sloppy, "short")
        summarizer(editor, GOOD)
        await sloppy.flush()
        await editor.flush()
        order = {"to": sloppy.id, "name": "summarize", "schema": SUMMARY, "escalate_to": supervisor.id}
        seen = await sloppy.request(boss.id, "verified", order, timeout=WAIT)
        assert (seen["state"], seen["output"]) == ("completed", {"summary": GOOD})
        assert [(a["agent"], a["verified"]) for a in seen["attempts"]] == [(sloppy.id, False), (supervisor.id, True)]
        assert seen["attempts"][0]["note"].endswith(f"; reassigned to {supervisor.id}")
        # To a Python supervisor, with reassignment off (the candidates are not asked).
        order = {
            "to": sloppy.id, "name": "summarize", "schema": SUMMARY,
            "reassign": False, "candidates": [supervisor.id], "escalate_to": editor.id,
        }
        seen = await sloppy.request(boss.id, "verified", order, timeout=WAIT)
        assert [(a["agent"], a["verified"]) for a in seen["attempts"]] == [(sloppy.id, False), (editor.id, True)]
        assert as_json(await asyncio.wait_for(editor.task_handle(seen["id"]).report(), WAIT)) == seen


async def test_a_python_worker_hands_its_task_to_a_rust_one_and_back(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-desk")
    async with py_agent(server, "py-front") as front, py_agent(server, "py-customer") as py:

        @front.task("triage")
        async def triage(task: TaskContext) -> str:
            order = task.data()
            await task.progress(0.2, "triaged")
            await task.handoff(f"{order['issue']} (triaged: network)", to=order["to"], name="ticket")
            return "not recorded"

        @front.task("ticket")
        async def ticket(task: TaskContext) -> str:
            return f"fixed by {front.id}: {task.data()}"

        await front.flush()
        # Python -> Rust: the requester's handle follows the task to the Rust worker.
        handle = await py.submit({"issue": "wifi down", "to": peer.id}, to=front.id, name="triage")
        assert await states_by(py, handle.id) == [
            (TaskState.SUBMITTED, py.id),
            (TaskState.ACCEPTED, front.id),
            (TaskState.WORKING, front.id),
            (TaskState.WORKING, peer.id),
            (TaskState.COMPLETED, peer.id),
        ]
        report = await handle.result(timeout=WAIT)
        assert report.data() == f"fixed by {peer.id}: wifi down (triaged: network)"
        assert [(a.agent, a.state) for a in report.attempts] == [
            (front.id, TaskState.WORKING),
            (peer.id, TaskState.COMPLETED),
        ]
        assert report.attempts[0].note == f"handed off by {front.id}"
        assert await rust_report(py, peer, handle.id) == as_json(report)

        # Rust -> Python: the Rust worker hands it to the Python one.
        order = {"to": front.id, "name": "ticket", "context": "printer jammed"}
        handle = await py.submit(order, to=peer.id, name="triage")
        report = await handle.result(timeout=WAIT)
        assert report.data() == f"fixed by {front.id}: printer jammed"
        assert [(a.agent, a.state, a.note) for a in report.attempts] == [
            (peer.id, TaskState.WORKING, f"handed off by {peer.id}"),
            (front.id, TaskState.COMPLETED, None),
        ]
        assert await rust_report(py, peer, handle.id) == as_json(report)

        # A verified task stays verified across the handoff: the Python worker reports its
        # result, and the requester accepts it.
        handle = await py.submit(order, to=peer.id, name="triage", verify=True)
        report = await asyncio.wait_for(py.verify(handle, lambda update: "printer" in update.data()), WAIT)
        assert (report.state, report.worker) == (TaskState.COMPLETED, front.id)
        assert turns(report) == [(peer.id, None), (front.id, True)]

        # A Rust requester watches a Python worker hand its task to the Rust one.
        seen = await py.request(
            peer.id, "submit", {"to": front.id, "command": "triage", "payload": {"issue": "vpn", "to": peer.id}}, timeout=WAIT
        )
        assert seen["states"] == ["submitted", "accepted", "working", "working", "completed"]
        assert (seen["worker"], seen["output"]) == (peer.id, f"fixed by {peer.id}: vpn (triaged: network)")

        # Only the agent working on a task may hand it on (5024), in both SDKs.
        for worker in (front.id, peer.id):
            intruder = Envelope.new(Kind.COMMAND, Performative.HANDOFF, py.id)
            intruder.correlation_id = handle.id
            intruder.to, intruder.name = [worker], "ticket"
            intruder.expect = Expect(Performative.INFORM, 5000)
            py.set_payload(intruder, "mine now", None)
            with pytest.raises(ChorusError) as refused:
                await py.exchange(py.subjects.command(worker, "ticket"), intruder, 5.0)
            assert refused.value.status == StatusCode.TASK_STATE, refused.value
            assert "cannot hand it on" in refused.value.reason
