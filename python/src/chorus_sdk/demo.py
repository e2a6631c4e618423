"""The Python agent of the `chorus up` demo: ``py-analyst``, which the Rust orchestrator asks
to review a text (it asks the Rust calculator to add up the words per line) and to outline a
topic as a task streamed chunk by chunk.

    python -m chorus_sdk.demo --server nats://127.0.0.1:4222

It prints ``chorus_sdk.demo: py-analyst ready`` once subscribed, and stops on Ctrl-C, SIGTERM or
the end of its standard input when that is a pipe (its parent's). A host runs it from
``deploy/demo/python/py-analyst.toml`` (``chorus up --python``): its id is then the replica's,
``CHORUS_AGENT_ID``, its server ``CHORUS_NATS_URL``, and the customer it is dedicated to
``CHORUS_CUSTOMER`` (the hosting manifest's ``customer``, when set): its manifest says so, and
a discovery for that customer finds it, one for another passes it by.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import stat
import sys
from typing import Any

from . import Agent, ChorusError, Context, StatusCode, TaskContext

AGENT_ID = os.environ.get("CHORUS_AGENT_ID") or "py-analyst"


def hosted_customer() -> str | None:
    """The customer a host runs this process for (``CHORUS_CUSTOMER``), as the Rust
    ``chorus agent`` and demo agents read it: unset or blank, none."""
    customer = os.environ.get("CHORUS_CUSTOMER")
    return customer if customer is not None and customer.strip() else None


def analyst(server: str) -> Agent:
    agent = Agent(AGENT_ID, servers=server, heartbeat_interval=2.0, customer=hosted_customer())

    @agent.command("review")
    async def review(ctx: Context) -> dict[str, Any]:
        text = ctx.data()
        if not isinstance(text, str) or not text.strip():
            raise ChorusError(StatusCode.INVALID_ARGUMENT, "review needs a text")
        per_line = [len(line.split()) for line in text.splitlines() if line.strip()]
        # A forward: the calculator (Rust) sees this request's conversation, one hop on.
        total = await ctx.request(
            "calculator", "calculation", {"operation": "add", "operands": [float(n) for n in per_line]}
        )
        longest = max(text.split(), key=len)
        return {"words_per_line": per_line, "words": int(total), "longest_word": longest, "computed_by": "calculator"}

    @agent.task("outline")
    async def outline(task: TaskContext) -> list[str]:
        topic = str(task.data())
        parts = [f"what {topic} are", f"how {topic} carry messages", f"why agents need {topic}"]
        for i, part in enumerate(parts):
            await task.progress((i + 1) / len(parts), f"part {i + 1} of {len(parts)}")
            await task.chunk(part, last=i == len(parts) - 1)
        return parts

    return agent


async def main(server: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def watch_stdin() -> None:
        # The parent closing our standard input means stop (it may die without a signal).
        while sys.stdin.readline():
            pass
        loop.call_soon_threadsafe(stop.set)

    # A pipe from the parent that started it; not a terminal, nor the empty input a host gives.
    if stat.S_ISFIFO(os.fstat(sys.stdin.fileno()).st_mode):
        loop.run_in_executor(None, watch_stdin)
    async with analyst(server) as agent:
        await agent.flush()
        print(f"chorus_sdk.demo: {AGENT_ID} ready at {server}", flush=True)
        await stop.wait()
    print(f"chorus_sdk.demo: {AGENT_ID} stopped", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m chorus_sdk.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--server", default=os.environ.get("CHORUS_NATS_URL", "nats://127.0.0.1:4222"))
    args = parser.parse_args()
    try:
        asyncio.run(main(args.server))
    except KeyboardInterrupt:
        pass
    # Do not wait for the stdin reader thread.
    os._exit(0)
