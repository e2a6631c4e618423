"""Tasks across languages through the task stream: a Python requester with a Rust worker and a
Rust requester with a Python worker, with progress, streamed chunks, a question answered, a
cancel, resuming after the last message seen, and a deadline."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from chorus_sdk import Agent, ChorusError, StatusCode, TaskContext, TaskState, Verification

from .conftest import py_agent

WAIT = 20.0


async def collect(handle: Any, after: int = 0) -> list[Any]:
    return [u async for u in handle.updates(after=after)]


async def test_a_python_requester_follows_a_rust_task_to_its_end_and_resumes(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-tasks")
    async with py_agent(server, "py-requester") as py:
        handle = await py.submit("tasks", to=peer.id, name="draft")
        updates = await asyncio.wait_for(collect(handle), WAIT)
        states = [u.state for u in updates if u.state is not None]
        assert states == [TaskState.SUBMITTED, TaskState.ACCEPTED, TaskState.WORKING, TaskState.COMPLETED]
        chunks = [(u.chunk, u.data()) for u in updates if u.chunk is not None]
        assert chunks == list(enumerate("a short draft about tasks".split(), start=1))
        assert [u.fraction for u in updates if u.fraction is not None] == [0.0, 1.0]
        # Every chunk is stored before the end.
        assert max(u.seq for u in updates if u.chunk) < updates[-1].seq
        result = await handle.result(timeout=WAIT)
        assert (result.state, result.status, result.worker) == (TaskState.COMPLETED, 5002, peer.id)
        assert result.data() == "a short draft about tasks"

        # Resumed after the third message, by id (as after a restart): the rest, once each.
        again = py.task_handle(str(handle.id))
        rest = await asyncio.wait_for(collect(again, after=updates[2].seq), WAIT)
        assert [u.seq for u in rest] == [u.seq for u in updates[3:]]
        assert await again.state() is TaskState.COMPLETED


async def test_a_python_requester_answers_a_rust_question_and_cancels_a_rust_task(server: Any, rust_peer: Any) -> None:
    peer = rust_peer("rust-tasks-2")
    async with py_agent(server, "py-requester-2") as py:
        question = await py.submit(None, to=peer.id, name="question")
        async for update in question.updates():
            if update.state is TaskState.INPUT_REQUIRED:
                assert update.envelope.reason == "which colour?"
                assert update.data() == ["red", "blue"]
                await question.respond("green")
        assert (await question.result(timeout=WAIT)).data() == "painted green"

        slow = await py.submit(None, to=peer.id, name="slow")
        async for update in slow.updates():
            if update.fraction is not None or update.envelope.reason == "waiting to be cancelled":
                break
        ended = await slow.cancel()
        assert (ended.state, ended.status, ended.worker) == (TaskState.CANCELLED, 5020, peer.id)

        with pytest.raises(ChorusError) as nobody:
            await py.submit(None, to="nobody-here", name="draft", timeout=2)
        assert nobody.value.status == StatusCode.NO_RESPONDERS


async def test_a_rust_requester_gets_progress_chunks_answers_and_cancels_from_a_python_worker(
    server: Any, rust_peer: Any
) -> None:
    peer = rust_peer("rust-requester")
    async with py_agent(server, "py-worker") as py:

        @py.task("compose")
        async def compose(task: TaskContext) -> str:
            topic = task.data()
            words = f"python writes about {topic}".split()
            await task.progress(0.5, "halfway", data={"words": len(words)})
            for i, word in enumerate(words):
                await task.chunk(word, last=i == len(words) - 1)
            return " ".join(words)

        @py.task("ask")
        async def ask(task: TaskContext) -> str:
            answer = await task.ask("how many?", ["one", "two"])
            return f"got {answer}"

        @py.task("stream")
        async def stream(task: TaskContext) -> None:
            n = 0
            while not task.is_cancelled:
                n += 1
                await task.chunk(n)
                await asyncio.sleep(0.05)

        @py.task("broken")
        async def broken(task: TaskContext) -> None:
            raise ChorusError(StatusCode.INVALID_ARGUMENT, "no such topic")

        await py.flush()
        seen = await py.request(peer.id, "submit", {"to": py.id, "command": "compose", "payload": "tasks"}, timeout=WAIT)
        assert seen["states"] == ["submitted", "accepted", "working", "completed"]
        assert seen["chunks"] == ["python", "writes", "about", "tasks"]
        assert seen["fractions"] == [0.5]
        assert (seen["state"], seen["status"], seen["worker"]) == ("completed", 5002, py.id)
        assert seen["output"] == "python writes about tasks"

        seen = await py.request(peer.id, "submit", {"to": py.id, "command": "ask", "answer": 2}, timeout=WAIT)
        assert seen["states"] == ["submitted", "accepted", "working", "input_required", "working", "completed"]
        assert seen["output"] == "got 2"

        seen = await py.request(peer.id, "submit", {"to": py.id, "command": "stream", "cancel_after_chunks": 2}, timeout=WAIT)
        assert (seen["state"], seen["status"]) == ("cancelled", 5020)
        assert seen["chunks"][:2] == [1, 2]

        seen = await py.request(peer.id, "submit", {"to": py.id, "command": "broken"}, timeout=WAIT)
        # The task failed with the handler's own code.
        assert seen["states"] == ["submitted", "accepted", "working", "failed"]
        assert (seen["state"], seen["status"]) == ("failed", StatusCode.INVALID_ARGUMENT)


async def test_a_task_past_its_deadline_expires(server: Any) -> None:
    async with py_agent(server, "py-slowpoke") as worker, py_agent(server, "py-impatient") as requester:

        @worker.task("forever")
        async def forever(task: TaskContext) -> None:
            await asyncio.sleep(3600)

        await worker.flush()
        handle = await requester.submit(None, to="py-slowpoke", name="forever", deadline=0.5)
        result = await handle.result(timeout=WAIT)
        assert (result.state, result.status, result.worker) == (TaskState.EXPIRED, 5011, "py-slowpoke")


async def test_a_python_requester_verifies_results_and_reassigns_a_failed_one(server: Any, rust_peer: Any) -> None:
    first, second = rust_peer("rust-writer-1"), rust_peer("rust-writer-2")
    async with py_agent(server, "py-checker") as py:
        handle = await py.submit("tasks", to=first.id, name="draft", verify=True)

        def not_from_the_first(report: Any) -> Any:
            return report.envelope.from_ != first.id or f"{first.id}'s drafts are not accepted"

        result = await asyncio.wait_for(py.verify(handle, not_from_the_first, candidates=[second.id]), WAIT)
        assert (result.state, result.status, result.worker) == (TaskState.COMPLETED, 5002, second.id)
        assert result.data() == "a short draft about tasks"
        updates = await collect(py.task_handle(handle.id))
        submitted = [u.envelope for u in updates if u.state is TaskState.SUBMITTED]
        assert [s.to for s in submitted] == [[first.id], [second.id]]
        assert submitted[1].reason == f"{first.id}'s drafts are not accepted; reassigned to {second.id}"
        assert [u.envelope.from_ for u in updates if u.kind == "report"] == [first.id, second.id]

    # A Python worker whose every result fails: retried once, reassigned, then 5025.
    async with py_agent(server, "py-sloppy") as sloppy, py_agent(server, "py-checker-2") as py:

        @sloppy.task("draft")
        async def draft(task: TaskContext) -> str:
            return "lorem ipsum"

        await sloppy.flush()
        handle = await py.submit("tasks", to="py-sloppy", name="draft", verify=True)
        result = await asyncio.wait_for(
            py.verify(handle, lambda report: "not a draft", retries=1, candidates=[first.id], max_attempts=4), WAIT
        )
        assert (result.state, result.status) == (TaskState.FAILED, StatusCode.UNVERIFIED)
        reports = [u.envelope.from_ for u in await collect(py.task_handle(handle.id)) if u.kind == "report"]
        assert reports == ["py-sloppy", "py-sloppy", first.id, first.id]


SUMMARY = {"type": "object", "required": ["summary"], "properties": {"summary": {"type": "string", "minLength": 10}}}
GOOD = "a summary long enough to pass"


async def test_a_worker_that_fails_its_allowed_retries_is_escalated_to_a_supervisor_who_completes_it(
    server: Any, rust_peer: Any
) -> None:
    drafter = rust_peer("rust-drafter", PEER_SUMMARY="short")
    async with py_agent(server, "py-chief") as chief, py_agent(server, "py-boss") as py:
        asked: list[tuple[str, Any, dict[str, str]]] = []

        @chief.task("summarize")
        async def summarize(task: TaskContext) -> dict[str, str]:
            asked.append((task.sender, task.data(), dict(task.headers)))
            return {"summary": GOOD}

        await chief.flush()
        # The Rust worker gets two more tries after its first failure, then the supervisor.
        policy = Verification.schema(SUMMARY, retries=2, escalate_to=chief.id, max_attempts=4)
        handle = await py.submit("a long document", to=drafter.id, name="summarize", verify=True, headers={"x-ticket": "T-9"})
        report = await asyncio.wait_for(py.verify(handle, policy), WAIT)
        assert (report.state, report.status, report.worker, report.requester) == (TaskState.COMPLETED, 5002, chief.id, py.id)
        assert report.data() == {"summary": GOOD}
        turns = [(a.agent, a.verified) for a in report.attempts]
        assert turns == [(drafter.id, False)] * 3 + [(chief.id, True)]
        for attempt, following in zip(report.attempts, [drafter.id, drafter.id, chief.id]):
            assert (attempt.note or "").startswith("does not meet the schema"), attempt.note
            assert (attempt.note or "").endswith(f"; reassigned to {following}"), attempt.note
        # The supervisor was asked once, by the requester, with the submission as it was.
        assert asked == [(py.id, "a long document", {"x-ticket": "T-9"})]
        # Each new attempt is a `submitted` from the requester to that agent alone, and the
        # requester writes `completed`; the Rust SDK reads the same report from the stream.
        updates = await asyncio.wait_for(collect(py.task_handle(handle.id)), WAIT)
        submitted = [(u.envelope.from_, u.envelope.to, u.envelope.headers) for u in updates if u.state is TaskState.SUBMITTED]
        assert submitted == [(py.id, [a], {"x-ticket": "T-9"}) for a in [drafter.id] * 3 + [chief.id]]
        assert (updates[-1].state, updates[-1].envelope.from_) == (TaskState.COMPLETED, py.id)
        seen = await py.request(drafter.id, "report", str(handle.id), timeout=WAIT)
        assert [(a["agent"], a["verified"]) for a in seen["attempts"]] == turns
        assert (seen["state"], seen["output"]) == ("completed", {"summary": GOOD})

        # With one attempt fewer allowed, the worker's tries use them all: the supervisor is
        # never asked and the task fails with 5025 and the chain of verdicts.
        handle = await py.submit("a long document", to=drafter.id, name="summarize", verify=True)
        report = await asyncio.wait_for(py.verify(handle, policy.with_policy(max_attempts=3)), WAIT)
        assert (report.state, report.status) == (TaskState.FAILED, StatusCode.UNVERIFIED)
        assert [a.agent for a in report.attempts] == [drafter.id] * 3
        assert (report.reason or "").startswith(f"no result passed verification in 3 attempts: attempt 1 by {drafter.id}")
        assert len(asked) == 1


async def test_a_rust_requester_escalates_a_python_worker_after_its_retries(server: Any, rust_peer: Any) -> None:
    boss = rust_peer("rust-boss")
    async with py_agent(server, "py-sloppy-2") as sloppy, py_agent(server, "py-chief-2") as chief:
        tries: list[str] = []

        @sloppy.task("summarize")
        async def sloppy_summary(task: TaskContext) -> dict[str, str]:
            tries.append(task.sender)
            return {"summary": "short"}

        @chief.task("summarize")
        async def chief_summary(task: TaskContext) -> dict[str, str]:
            return {"summary": GOOD}

        await sloppy.flush()
        await chief.flush()
        order = {"to": sloppy.id, "name": "summarize", "schema": SUMMARY, "retries": 1, "escalate_to": chief.id, "max_attempts": 3}
        seen = await sloppy.request(boss.id, "verified", order, timeout=WAIT)
        assert (seen["state"], seen["requester"], seen["output"]) == ("completed", boss.id, {"summary": GOOD})
        assert [(a["agent"], a["verified"]) for a in seen["attempts"]] == [(sloppy.id, False), (sloppy.id, False), (chief.id, True)]
        assert seen["attempts"][1]["note"].endswith(f"; reassigned to {chief.id}")
        assert tries == [boss.id, boss.id]
        # The Python SDK reads the same report from the task's stream.
        report = await asyncio.wait_for(chief.task_handle(seen["id"]).report(), WAIT)
        assert [(a.agent, a.verified) for a in report.attempts] == [(sloppy.id, False), (sloppy.id, False), (chief.id, True)]
