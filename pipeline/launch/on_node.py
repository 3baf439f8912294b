"""What a node launcher (ssh, srun) runs on each node: the node's agent, given what only the node can know, and
ended with the run that started it.

    python -m gptforge.pipeline.launch.on_node --node N --master ADDR [--addrs A0,A1,...] [--ssh] -- AGENT...

- **Its address:** `--addrs`' entry N (`distributed.node_addrs`, or the hostfile's entry where it is an address),
  else the address this host reaches the master from (its route there), never what its hostname resolves to: many
  cloud images resolve a host's own name to 127.0.0.1, where no other node can reach it.
- **Passed on** to the agent: `PET_LOCAL_ADDR` (torchrun's and accelerate's `--local-addr`: where rank 0's agent
  has its workers meet, its own FQDN otherwise) and `GLOO_SOCKET_IFNAME`, the interface that holds the address,
  unless set (gloo binds what the hostname resolves to otherwise). `__NODE_IS_HOST__` in the command becomes
  `is_host=true` on node 0 and `is_host=false` elsewhere (the accelerate launcher's rendezvous, which node 0 hosts).
- **The environment** the run gives every node (pipeline/launch/nodes.py: node_env) comes over ssh as stdin's first
  line, a JSON object, so that no token is on a command line.
- **Ended with the run** (over ssh; srun ends its tasks itself): it reads its stdin, the ssh channel, to the
  end. Once the starting side is gone (the stage failed on another node, was cancelled, or the network between
  them went down), the agent and every process under it get SIGTERM, then SIGKILL after a grace period. It is their
  subreaper: torchrun's workers, in sessions of their own, are still found under it once their agent is gone. Its
  exit code is the agent's.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

GRACE_S = 5.0
PR_SET_CHILD_SUBREAPER = 36
SIOCGIFADDR = 0x8915


def route_to(master: str) -> str:
    """The address this host's packets to `master` leave from (no packet is sent)."""
    family = socket.AF_INET6 if ":" in master else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((master, 9))
        return s.getsockname()[0]


def interface_of(addr: str) -> str | None:
    """The network interface holding the IPv4 address `addr`, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(got[20:24]) == addr:
                return name
    return None


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # [state, ppid, ...]


def descendants(root: int) -> list[int]:
    """Every live process under `root` (zombies left out), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                state, ppid = _stat(int(entry))[:2]
            except (OSError, IndexError):
                continue
            if state != "Z":
                children.setdefault(int(ppid), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def reap(agent: subprocess.Popen) -> None:
    """Collect the exit status of what ended under this one (orphans come to it, their subreaper)."""
    agent.poll()
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid <= 0:
            return
        if pid == agent.pid:  # reaped here before Popen saw it
            agent.returncode = os.waitstatus_to_exitcode(status)


def end_all(agent: subprocess.Popen, grace: float = GRACE_S) -> None:
    """SIGTERM every process under this one, then SIGKILL what is left after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while True:
            reap(agent)
            if not descendants(os.getpid()) or time.monotonic() > deadline:
                break
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gptforge.pipeline.launch.on_node")
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--addrs", default="")
    p.add_argument("--ssh", action="store_true", help="started over ssh: stdin is the channel (the environment, "
                   "then its end is the run's)")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    addrs = args.addrs.split(",") if args.addrs else []  # (an empty entry: that node finds its own)
    host = socket.gethostname()
    env = dict(os.environ)
    if args.ssh:
        line = b""
        while not line.endswith(b"\n") and (chunk := os.read(0, 1)):  # (one byte at a time: the rest is the channel)
            line += chunk
        env.update(json.loads(line or b"{}"))
    addr = addrs[args.node] if args.node < len(addrs) and addrs[args.node] else route_to(args.master)
    env["PET_LOCAL_ADDR"] = addr
    if "GLOO_SOCKET_IFNAME" not in env and ":" not in addr:
        interface = interface_of(addr)
        if interface is None:
            print(f"error: node {args.node} ({host}): no interface of this host holds its address {addr} "
                  f"(distributed.node_addrs[{args.node}] or the hostfile)", file=sys.stderr)
            return 2
        env["GLOO_SOCKET_IFNAME"] = interface
    cmd = [a.replace("__NODE_IS_HOST__", f"is_host={'true' if args.node == 0 else 'false'}") for a in cmd]
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)
    gone = threading.Event()

    def watch_stdin():  # the channel to the starting side: its end is the run's
        try:
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        gone.set()

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: gone.set())
    agent = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
    if args.ssh:  # (srun ends its tasks itself; their stdin is /dev/null but task 0's)
        threading.Thread(target=watch_stdin, daemon=True).start()
    while agent.poll() is None and not gone.wait(0.2):
        pass
    end_all(agent)  # the agent's leftovers when it ended by itself; everything when the run is gone
    code = agent.wait()
    return 143 if gone.is_set() and code == 0 else code


if __name__ == "__main__":
    sys.exit(main())
