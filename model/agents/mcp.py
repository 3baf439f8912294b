"""Tools someone already serves, over the Model Context Protocol (the `mcp` package, with the `environments` extra):
`preference.tools` entries `mcp:<command line>` (a server started over stdio) or an `http(s)://` URL (a server
over streamable HTTP).

A server's tools are listed with their JSON schemas, which the chat template renders like gptforge's own tools, and
each becomes a tool of the rollouts: called under `preference.tool_timeout_s` and `preference.tool_concurrency`
(its calls are `async def`, awaited on the rollout process's event loop, gptforge.model.agents.concurrency), its
error (the server's `is_error` result, a protocol error, a timeout) the message the model reads.

A stdio server is one a rollout process (the training process in sync mode, each rollout worker in async mode),
started when the process loads its tools and ended with the process (or `close`); the preflight starts it once to
list its tools and ends it. Its stderr goes to a file whose tail names what went wrong where it does not start. A
command that does not start, a server that does not answer within `CONNECT_S`, or one that lists no tools is one
error line naming the entry, before anything runs.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import shlex
import tempfile
import threading
from collections.abc import Callable
from contextlib import AsyncExitStack

from gptforge.core.errors import ConfigError
from gptforge.core.extras import require
from gptforge.model.agents.concurrency import event_loop

KEY = "preference.tools"
CONNECT_S = 30.0
_servers: dict[str, Server] = {}
_lock = threading.Lock()


def is_mcp(spec: str) -> bool:
    return spec.startswith(("mcp:", "http://", "https://"))


def tools(spec: str, timeout_s: float, output_chars: int = 16_384) -> list[Callable]:
    """The tools of the MCP server `spec` names, its session started in this process where it is not yet; what a
    call returns is cut at `output_chars` (the sandbox's output limit: an MCP server runs outside it, as the
    trainer's user, and its output must not flood an episode)."""
    with _lock:
        server = _servers.get(spec)
        if server is None:
            server = _servers[spec] = Server(spec, timeout_s)
    return server.tools(output_chars)


def close(spec: str | None = None) -> None:
    """End this process's session with `spec`'s server (with every server's, without `spec`)."""
    with _lock:
        ending = [_servers.pop(s) for s in ([spec] if spec else list(_servers)) if s in _servers]
    for server in ending:
        server.close()


atexit.register(close)


class Server:
    """A session with one MCP server, held on the process's event loop: entered and left by one task (anyio's task
    groups), called from any thread."""

    def __init__(self, spec: str, timeout_s: float):
        require("mcp", f"{KEY}: {spec}")
        self.spec, self.timeout_s = spec, timeout_s
        self.errlog = tempfile.TemporaryFile("w+")
        self.client = None
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        self._holder = asyncio.run_coroutine_threadsafe(self._hold(), event_loop())
        try:
            self._ready.result(CONNECT_S + 5)
            self.listed = asyncio.run_coroutine_threadsafe(self.client.list_tools(), event_loop()).result(CONNECT_S)
        except BaseException as e:  # noqa: BLE001 (named in one line)
            self.close()
            raise ConfigError(f"{KEY}: MCP server {spec} does not start: {why(e)}{self._stderr()}") from None
        if not self.listed.tools:
            self.close()
            raise ConfigError(f"{KEY}: MCP server {spec} lists no tools")

    async def _hold(self):
        from mcp import Client, StdioServerParameters, stdio_client

        self._stop = asyncio.Event()
        try:
            async with AsyncExitStack() as stack:
                if self.spec.startswith("mcp:"):
                    argv = shlex.split(self.spec.removeprefix("mcp:"))
                    if not argv:
                        raise ValueError("no command after mcp:")
                    transport = stdio_client(StdioServerParameters(command=argv[0], args=argv[1:]),
                                             errlog=self.errlog)
                else:
                    import httpx2
                    from mcp.client.streamable_http import streamable_http_client

                    http = await stack.enter_async_context(httpx2.AsyncClient(  # no proxy from the environment
                        follow_redirects=True, trust_env=False, timeout=httpx2.Timeout(30.0, read=300.0)))
                    transport = streamable_http_client(self.spec, http_client=http)
                # legacy: the initialize handshake every server answers, under the read timeout (the newer discovery
                # probe waits 10 s whatever the timeout on a command that is not an MCP server)
                client = Client(transport, mode="legacy", read_timeout_seconds=CONNECT_S)
                self.client = await stack.enter_async_context(client)
                self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as e:
            if not self._ready.done():
                self._ready.set_exception(e)
        finally:
            self.client = None

    def tools(self, output_chars: int) -> list[Callable]:
        return [self._tool(t, output_chars) for t in self.listed.tools]

    def _tool(self, listed, output_chars: int) -> Callable:
        name = listed.name

        async def call(**arguments) -> str:
            import mcp_types as types

            client = self.client
            if client is None:
                raise RuntimeError(f"the MCP server {self.spec} has ended")
            result = await client.call_tool(name, arguments, read_timeout_seconds=self.timeout_s)
            text = "\n".join(b.text for b in result.content if isinstance(b, types.TextContent))
            if len(text) > output_chars:
                text = text[:output_chars] + f"\n[cut at {output_chars} characters]"
            if result.is_error:
                raise RuntimeError(text or "the tool reported an error")
            return text

        call.__name__ = call.__qualname__ = name
        call.json_schema = {"type": "function", "function": {
            "name": name, "description": listed.description or listed.title or name,
            "parameters": listed.input_schema or {"type": "object", "properties": {}}}}
        return call

    def close(self) -> None:
        if self._stop is not None and not self._holder.done():
            event_loop().call_soon_threadsafe(self._stop.set)
            try:
                self._holder.result(10)
            except BaseException:  # noqa: BLE001 (ending it is all that is left to do)
                pass

    def _stderr(self) -> str:
        self.errlog.flush()
        self.errlog.seek(0)
        tail = self.errlog.read().strip().splitlines()[-3:]
        return f" (its stderr: {' | '.join(tail)})" if tail else ""


def why(e: BaseException) -> str:
    """The innermost errors of what anyio's task groups raise, on one line."""
    leaves = list(leaf_errors(e))
    return "; ".join(f"{type(x).__name__}: {x}" for x in leaves) or type(e).__name__


def leaf_errors(e: BaseException):
    if hasattr(e, "exceptions"):  # an exception group (anyio's task groups)
        for x in e.exceptions:
            yield from leaf_errors(x)
    else:
        yield e
