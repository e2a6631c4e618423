"""The official a2a-sdk's own server with an echo agent: `chorus bench --python <python>` times
an A2A SendMessage to it beside the same call to the Chorus gateway's A2A binding.

    python a2a_reference_server.py PORT     (needs a2a-sdk[http-server], which
                                             scripts/install-python-sdk installs)

Each message becomes a task that is worked on, gets one artifact (the text echoed) and
completes: the same steps the gateway's binding reports for a Chorus task.
"""

import sys

import uvicorn
from a2a.helpers import new_task_from_user_message, new_text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill
from starlette.applications import Starlette

PORT = int(sys.argv[1])


class Echo(AgentExecutor):
    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        task = context.current_task or new_task_from_user_message(context.message)
        await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        await updater.start_work()
        await updater.add_artifact([new_text_part(context.get_user_input())], name="result", last_chunk=True)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


card = AgentCard(
    name="echo",
    description="echoes the message as the task's artifact",
    version="1.0.0",
    supported_interfaces=[AgentInterface(url=f"http://127.0.0.1:{PORT}/", protocol_binding="JSONRPC", protocol_version="1.0")],
    capabilities=AgentCapabilities(streaming=True),
    default_input_modes=["text/plain"],
    default_output_modes=["text/plain"],
    skills=[AgentSkill(id="echo", name="echo", description="echoes", tags=["echo"])],
)
handler = DefaultRequestHandler(agent_executor=Echo(), task_store=InMemoryTaskStore(), agent_card=card)
app = Starlette(routes=create_agent_card_routes(card) + create_jsonrpc_routes(handler, rpc_url="/"))
uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")
