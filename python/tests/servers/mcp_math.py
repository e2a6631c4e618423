"""A small MCP server written with the official Python `mcp` package, that the bridge tests
put on the bus: on standard input and output (`chorus mcp bridge --agent mcp-math -- python
mcp_math.py`), or with `--http PORT` over Streamable HTTP at `http://127.0.0.1:PORT/mcp`
(`chorus mcp bridge --agent mcp-math --url ...`). `add` adds two numbers, `divide` refuses a
zero divisor with a tool error, and `pid` says which process answered (a restarted server is
another)."""

from __future__ import annotations

import os
import sys

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
    if sys.argv[1:2] == ["--http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
