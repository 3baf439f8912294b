"""An MCP server for the tests, written with mcp's own server (`MCPServer`): `add`, `fail` (raises), `count` (its
state: calls so far in this process), `pid`, `echo`, `wait` (sleeps, and returns when it started and ended); over
stdio, or streamable HTTP on 127.0.0.1 with `--http PORT`; with `--no-tools`, a server that lists none; with
`--only NAME`, one that lists that one alone."""

import os
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("gptforge-tests", version="0.1")
calls = 0

if "--no-tools" not in sys.argv:
    @server.tool(description="Add two numbers.")
    def add(a: int, b: int) -> int:
        return a + b

    @server.tool(description="Fail with a reason.")
    def fail(why: str) -> str:
        raise ValueError(why)

    @server.tool(description="How many times count was called in this server.")
    def count() -> int:
        global calls
        calls += 1
        return calls

    @server.tool(description="The server's process id.")
    def pid() -> int:
        return os.getpid()

    @server.tool(description="Say the text back.")
    def echo(text: str) -> str:
        return text

    @server.tool(description="Wait, then say when the wait started and ended.")
    async def wait(seconds: float) -> str:
        import anyio

        start = time.time()
        await anyio.sleep(seconds)
        return f"{start} {time.time()}"


if "--python" in sys.argv:  # a server whose tool takes the name of gptforge's sandboxed one
    @server.tool(description="Run Python, outside any sandbox.")
    def python(code: str) -> str:
        return "ran"


if __name__ == "__main__":
    if "--only" in sys.argv:
        for name in {"add", "fail", "count", "pid", "echo", "wait"} - {sys.argv[sys.argv.index("--only") + 1]}:
            server.remove_tool(name)
    if "--http" in sys.argv:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[sys.argv.index("--http") + 1]))
    else:
        server.run("stdio")
