"""Tools served over the Model Context Protocol (gptforge.model.agents.mcp), from a server written with mcp's own
classes (tests/mcp_server.py): listed with their schemas and rendered by the chat template, called from episodes at
once under the tool timeout, their errors the model's messages, a stdio server one a process and ended with it,
streamable HTTP too; and the mistakes a user can make, each one error line."""

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from gptforge.core.errors import UserError
from gptforge.model.agents import mcp
from gptforge.model.agents.episode import render, rollouts
from gptforge.model.agents.tools import Setup
from tests.model.test_rollout import call_text, scripted, tokenizers  # noqa: F401 (a fixture)

SERVER = f"mcp:{sys.executable} {os.path.join(os.path.dirname(os.path.dirname(__file__)), 'mcp_server.py')}"


@pytest.fixture
def stdio():
    yield SERVER
    mcp.close()


def test_a_stdio_servers_tools_in_episodes_at_once_and_its_life(tokenizers, stdio):  # noqa: F811
    tok = tokenizers["hermes"]
    setup = Setup.load(None, [stdio], timeout_s=5, concurrency=4)
    assert [fn.__name__ for fn in setup.tools] == ["add", "fail", "count", "pid", "echo", "wait"]
    box = setup.toolbox({})
    add = next(s for s in box.schemas if s["function"]["name"] == "add")["function"]
    assert add["description"] == "Add two numbers." and add["parameters"]["required"] == ["a", "b"]
    assert '"name": "add"' in render(tok, [{"role": "user", "content": "hi"}], box.schemas, True)  # as the template
    turns = [call_text("hermes", "add", {"a": 2, "b": 3}), call_text("hermes", "fail", {"why": "no"}),
             call_text("hermes", "add", {"a": "x"}), "Done."]
    sample, eot = scripted(tok, turns, [])
    [e] = rollouts(setup, sample, tok, [{"prompt": [{"role": "user", "content": "Add."}]}], "hermes", max_turns=4,
                   max_length=4096, stop_ids={eot})
    assert [m["content"] for m in e.messages if m["role"] == "tool"][0] == "5"
    assert e.calls[1].error.startswith("RuntimeError: Error executing tool fail: no")  # the server's error, read
    assert "validation error" in e.calls[2].error and e.ended == "answer"

    # four episodes call `wait` in one turn: the calls overlap on the one session
    waits = [call_text("hermes", "wait", {"seconds": 0.5})] * 4 + ["ok"] * 4
    sample, eot = scripted(tok, waits, [])
    rows = [{"prompt": [{"role": "user", "content": f"Wait {i}."}]} for i in range(4)]
    episodes = rollouts(setup, sample, tok, rows, "hermes", max_turns=2, max_length=4096, stop_ids={eot})
    spans = [tuple(map(float, e.calls[0].result.split())) for e in episodes]
    assert max(s for s, _ in spans) < min(end for _, end in spans)  # all four were waiting at once
    counts = [setup.toolbox({}).call("count", {}).result for _ in range(3)]
    assert counts == ["1", "2", "3"]  # one server for the process, its state kept across episodes

    slow = Setup.load(None, [stdio], timeout_s=0.2).toolbox({}).call("wait", {"seconds": 2})
    assert slow.error.startswith("TimeoutError: wait did not return within 0.2 s")
    pid = int(box.call("pid", {}).result)
    mcp.close()
    for _ in range(100):  # the server ends with its session
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the MCP server {pid} outlived its session")


def test_a_streamable_http_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, SERVER.split()[-1], "--http", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        for _ in range(200):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        setup = Setup.load(None, [url], timeout_s=5)
        assert setup.toolbox({}).call("add", {"a": 40, "b": 2}).result == "42"
    finally:
        mcp.close()
        server.terminate()
        server.wait(10)


def test_mcp_mistakes_are_one_line_naming_the_entry():
    cases = [("mcp:/no/such/server", r"MCP server mcp:/no/such/server does not start: FileNotFoundError"),
             (f"mcp:{sys.executable} -c pass", r"does not start: MCPError: Connection closed"),
             (f"{SERVER} --no-tools", r"lists no tools")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        cases.append((f"http://127.0.0.1:{s.getsockname()[1]}/mcp", r"does not start: ConnectError"))
    for spec, line in cases:
        with pytest.raises(UserError, match=r"preference.tools: .*" + line):
            Setup.load(None, [spec], timeout_s=5)
    # a name two tools take: a server's own `python` would stand in for the sandboxed one; two servers' `add`
    for tools, name, first in ((["python", f"{SERVER} --python"], "python", "python"),
                               ([SERVER, f"{SERVER} --only add"], "add", SERVER)):
        with pytest.raises(UserError, match=rf"preference.tools: two tools named '{name}', from {re.escape(first)} "
                                            r"and from .*; a tool's name must be unique"):
            Setup.load(None, tools, timeout_s=5)


def test_an_mcp_tools_output_is_cut_like_the_sandboxs(stdio):
    """An MCP server runs outside the sandbox, as the trainer's user: what its tool returns is cut at the sandbox's
    output limit, as the python tool's is."""
    box = Setup.load(None, [f"{stdio} --only echo"], timeout_s=5, sandbox={"output_bytes": 100}).toolbox({})
    assert box.call("echo", {"text": "x" * 500}).result == "x" * 100 + "\n[cut at 100 characters]"
    assert box.call("echo", {"text": "short"}).result == "short"
