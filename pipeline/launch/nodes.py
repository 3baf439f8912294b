"""Starting a stage's processes on every node: the agent each node runs (deepspeed, torchrun or accelerate), how a
run reaches the nodes (`distributed.node_launcher`), and the rendezvous they meet at.

- `local`: every node's agent on this host, each with its own node rank: one machine with several nodes' worth of
  processes, and the tests, which meet through the same c10d rendezvous as real nodes do.
- `ssh`: one agent per host of `distributed.hostfile` (node 0 first), started over ssh in this folder with this
  Python: the hosts share a file system (the run root and the virtual environment).
- `slurm`: one `srun` inside an allocation, one task per node, each taking its node rank from SLURM_NODEID.
- The deepspeed launcher reaches other nodes by itself, through its hostfile (pdsh or ssh).

The rendezvous: for torchrun and the deepspeed launcher, this process hosts the TCPStore the agents and ranks meet
at, listening on `master_addr` alone, at a free port unless `distributed.master_port` pins one (every agent is
its client: c10d with is_host=false; the deepspeed launcher's ranks through TORCHELASTIC_USE_AGENT_STORE). So
many runs share a host, and the store listens only where it is told. Two are torch's own: the accelerate
launcher (the TRL stages) refuses a port that is taken and starts its store itself, on a free port found here;
and torch's elastic agent of rank 0 opens the workers' bootstrap store on its node. Both listen on all interfaces.
"""

from __future__ import annotations

import base64
import datetime
import fnmatch
import json
import os
import shlex
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gptforge.core.config import PipelineConfig
from gptforge.model.train.tracking import PARENT_ENV
from gptforge.core.errors import UserError
from gptforge.stages.entry import stage_args
from gptforge.core.declarations import STAGES

SLURM_NODE = "__SLURM_NODEID__"  # replaced by $SLURM_NODEID in the srun command


def single_process(cfg: PipelineConfig, step: str) -> bool:
    """Tokenizing (its own Ray workers) runs as one process, without a launcher; so does evaluation unless it
    runs on every process (`eval.processes`)."""
    return STAGES[step].launcher == "single" and not (STAGES[step].evaluates and evaluation_on_every_rank(cfg))


def evaluation_on_every_rank(cfg: PipelineConfig) -> bool:
    """Whether an evaluation step runs on every process of the distributed layout (`eval.processes`); auto: where
    the stage starts has a GPU, or its nodes are reached over ssh or slurm."""
    if cfg.eval.processes != "auto":
        return cfg.eval.processes == "all"
    import torch  # (the host that starts the stage decides: a CPU head node sending it to a GPU pool does not)

    return torch.cuda.is_available() or cfg.distributed.node_launcher != "local"


def launcher_of(cfg: PipelineConfig, stage: str) -> str:
    """The agent that starts a stage's ranks: the configured one, but accelerate for the TRL stages under deepspeed
    and torchrun (gptforge's agent gives them accelerate's environment itself: `node_env`)."""
    launcher = cfg.distributed.launcher
    trainer = STAGES[stage].launcher == "accelerate"  # a TRL Trainer needs accelerate to see the world (hf_trainer)
    return "accelerate" if trainer and launcher in ("deepspeed", "torchrun") else launcher


def deepspeed_runner(cfg: PipelineConfig) -> bool:
    """Whether the deepspeed runner reaches the nodes itself, through its hostfile (pdsh or ssh): the deepspeed
    launcher with a hostfile and node_launcher local. Under ssh and slurm, gptforge starts DeepSpeed's per-node
    launcher on each node itself, as it does the other agents."""
    d = cfg.distributed
    return d.launcher == "deepspeed" and bool(d.hostfile) and d.node_launcher == "local"


def hosts_rendezvous(cfg: PipelineConfig, stage: str) -> bool:
    """Whether this process hosts the stage's rendezvous store (see the module's docstring)."""
    launcher = launcher_of(cfg, stage)
    return not single_process(cfg, stage) and (launcher in ("gptforge", "torchrun") or launcher == "deepspeed"
                                                and not deepspeed_runner(cfg))


@contextmanager
def rendezvous(cfg: PipelineConfig, stage: str) -> Iterator[int | None]:
    """The stage's rendezvous port for the block; this process hosts the store where it should (None: a single
    process needs none)."""
    if single_process(cfg, stage):
        yield None
        return
    d = cfg.distributed
    sock = socket.socket(socket.AF_INET6 if ":" in d.master_addr else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((d.master_addr, d.master_port or 0))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on distributed.master_addr={d.master_addr}, distributed.master_port="
                        f"{d.master_port} ({e.strerror}); leave master_port unset for a free port") from None
    port = sock.getsockname()[1]
    if not hosts_rendezvous(cfg, stage):
        sock.close()  # the launcher's own store takes the port
        yield port
        return
    from torch.distributed import TCPStore

    sock.listen(1024)
    store = TCPStore(d.master_addr, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                     master_listen_fd=sock.detach(), timeout=datetime.timedelta(minutes=30))  # the store owns it
    try:
        yield port
    finally:
        del store


def agent_command(cfg: PipelineConfig, stage: str, config_path: Path, out_dir: Path, inputs: dict[str, Path],
                  node: int | str = 0, port: int | None = None) -> list[str]:
    """What one node runs: the stage under its launcher, as node `node`, meeting at master_addr:`port`."""
    module, args = f"gptforge.stages.{STAGES[stage].module}", stage_args(config_path, out_dir, inputs)
    if single_process(cfg, stage):
        return [sys.executable, "-m", module, *args]
    d = cfg.distributed
    port = port or d.master_port
    launcher = launcher_of(cfg, stage)
    if launcher == "gptforge":
        cmd = [sys.executable, "-m", "gptforge.pipeline.launch.agent", f"--nproc-per-node={d.nproc_per_node}",
               f"--nnodes={d.nnodes}", f"--node-rank={node}", f"--master={d.master_addr}:{port}"]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={d.nproc_per_node}",
               f"--nnodes={d.nnodes}", f"--node_rank={node}", "--rdzv_backend=c10d",
               f"--rdzv_endpoint={d.master_addr}:{port}", "--rdzv_conf=is_host=false", f"--rdzv_id={stage}-{port}",
               "--max_restarts=0"]
    elif launcher == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed",
               "--zero_stage", str(d.zero_stage), "--num_processes", str(d.world_size),
               "--num_machines", str(d.nnodes), "--machine_rank", str(node),
               "--main_process_ip", d.master_addr, "--main_process_port", str(port)]
        if d.nnodes > 1:
            cmd += ["--deepspeed_multinode_launcher", "standard", "--rdzv_backend", "c10d"]
            if d.node_launcher != "local":  # node 0 hosts it: what its hostname resolves to need not say so
                cmd += ["--rdzv_conf", "__NODE_IS_HOST__"]
    elif deepspeed_runner(cfg):  # the deepspeed runner reaches the nodes itself (pdsh or ssh)
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_addr", d.master_addr,
               "--master_port", str(port), "--hostfile", d.hostfile]
        return [*cmd, "--module", module, *args]
    else:  # DeepSpeed's per-node launcher, started as its runner would (which imports DeepSpeed once more)
        hosts = {f"node{n}" if d.nnodes > 1 else "localhost": list(range(d.nproc_per_node)) for n in range(d.nnodes)}
        world = base64.urlsafe_b64encode(json.dumps(hosts).encode()).decode()
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
               f"--node_rank={node}", f"--master_addr={d.master_addr}", f"--master_port={port}"]
        return [*cmd, "--module", module, *args]
    return [*cmd, "-m", module, *args]


def node_commands(cfg: PipelineConfig, stage: str, config_path: Path, out_dir: Path, inputs: dict[str, Path],
                  port: int | None, env: dict[str, str]) -> list[list[str]]:
    """The commands this process starts for a stage: one agent per node (local, ssh), one srun for all (slurm),
    one launcher that reaches the nodes itself (a single node, or the deepspeed runner with a hostfile). On ssh and
    slurm nodes the agent runs under pipeline/launch/on_node.py; over ssh, `env` is written down the channel as the
    first line (run_streaming), not put on a command line."""
    d = cfg.distributed
    if single_process(cfg, stage) or d.nnodes == 1 or launcher_of(cfg, stage) == "deepspeed" and deepspeed_runner(cfg):
        return [agent_command(cfg, stage, config_path, out_dir, inputs, d.node_rank, port)]
    if d.node_launcher == "local":
        return [agent_command(cfg, stage, config_path, out_dir, inputs, n, port) for n in range(d.nnodes)]

    ssh = d.node_launcher == "ssh"  # the environment goes down the channel, never on a command line (HF_TOKEN)
    hosts = read_hostfile(d.hostfile)[:d.nnodes] if d.hostfile else []
    addrs = node_addresses(cfg, hosts)
    addrs_arg = ",".join(a or "" for a in addrs) if any(addrs) else ""  # (empty entries: those nodes find their own)

    def on_node(node: int | str) -> str:  # the agent, under the node's side of the launch (pipeline/launch/on_node.py)
        wrapper = [sys.executable, "-m", "gptforge.pipeline.launch.on_node", f"--node={node}",
                   f"--master={d.master_addr}", *([f"--addrs={addrs_arg}"] if addrs_arg else []),
                   *(["--ssh"] if ssh else []), "--"]
        return shlex.join([*wrapper, *agent_command(cfg, stage, config_path, out_dir, inputs, node, port)])

    if ssh:
        return [["ssh", *SSH_OPTIONS, host, f"cd {shlex.quote(os.getcwd())} && {on_node(n)}"]
                for n, host in enumerate(hosts)]
    # srun passes its own environment (run_streaming's `env` on top of this process's) to every task
    return [["srun", f"--nodes={d.nnodes}", f"--ntasks={d.nnodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
             "bash", "-c", on_node(SLURM_NODE).replace(SLURM_NODE, "$SLURM_NODEID")]]


# ssh to a node: never a prompt; a node that stops answering (down, or the network between) ends it in about 30 s
SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3"]


def node_addresses(cfg: PipelineConfig, hosts: list[str]) -> list[str | None]:
    """Each node's address as the others reach it: `distributed.node_addrs`, else its entry of `hosts` (the
    hostfile's) where that is an address; None where the node finds its own (its route to master_addr:
    pipeline/launch/on_node.py)."""
    import ipaddress

    d = cfg.distributed
    if d.node_addrs:
        return list(d.node_addrs)

    def address(host: str) -> str | None:
        try:
            return str(ipaddress.ip_address(host))
        except ValueError:
            return None

    return [address(h) for h in hosts] + [None] * (d.nnodes - len(hosts))


def read_hostfile(path: str) -> list[str]:
    """Host names of a hostfile (DeepSpeed's format: `host slots=N` a line; # comments)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UserError(f"distributed.hostfile={path}: {e.strerror}") from None
    return [line.split()[0] for line in lines if line.strip() and not line.lstrip().startswith("#")]


# What reaches every node's processes from the host that starts a stage, whatever launches it (srun forwards the
# whole environment; ssh and the deepspeed runner almost nothing): the collectives' interfaces and settings, the
# hub's cache and offline switches, thread counts and the modules of user code (rewards, tools, environments).
# OMP_*: OpenMP's runtime settings (OMP_NUM_THREADS, OMP_WAIT_POLICY, OMP_PROC_BIND) are a node's as much as the
# launching host's
FORWARDED = ("NCCL_*", "GLOO_*", "HF_*", "OMP_*", "PYTHONPATH")


def forwarded_env(cfg: PipelineConfig) -> dict[str, str]:
    """FORWARDED's variables set here, then `distributed.env`."""
    env = {k: v for k, v in os.environ.items() if any(fnmatch.fnmatchcase(k, p) for p in FORWARDED)}
    return {**env, **cfg.distributed.env}


def node_env(cfg: PipelineConfig, stage: str) -> dict[str, str]:
    """Environment of a stage's processes: what is forwarded to every node (FORWARDED, `distributed.env`);
    DeepSpeed's CPU accelerator where there is no GPU; the deepspeed launcher's ranks as clients of the hosted
    store."""
    import torch

    env = forwarded_env(cfg)
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    if PARENT_ENV in os.environ:  # the pipeline's MLflow run, to nest the stage's under (on every node)
        env[PARENT_ENV] = os.environ[PARENT_ENV]
    if hosts_rendezvous(cfg, stage) and launcher_of(cfg, stage) == "deepspeed":
        env.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    if STAGES[stage].launcher == "accelerate" and launcher_of(cfg, stage) != "accelerate":  # as `accelerate launch`
        env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE=str(cfg.distributed.zero_stage))
    return env
