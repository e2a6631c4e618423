"""A small MCP server on standard input and output, written with the official Python `mcp`
package, that the bridge tests put on the bus (`chorus mcp bridge --agent mcp-math -- python
mcp_math.py`): `add` adds two numbers, `divide` refuses a zero divisor with a tool error, and
`pid` says which process answered (a restarted server is another)."""

from __future__ import annotations

import os

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("mcp-math")


@server.tool()
def add(a: float, b: float) -> float:
    """Adds two numbers."""
    return a + b


@server.tool()
def divide(a: float, b: float) -> float:
    """Divides a by b."""
    if b == 0:
        raise ToolError("division by zero")
    return a / b


@server.tool()
def pid() -> int:
    """The process id of this server."""
    return os.getpid()


if __name__ == "__main__":
    server.run("stdio")
