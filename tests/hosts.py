"""Two hosts on this machine, for the tests of runs across nodes: two Linux network namespaces joined by a veth
pair, each with its own address, hostname, hosts file and sshd (key login), sharing the file system (the checkout,
its virtual environment and the run root), as hosts on a shared file system do.

Each host is a holder process (`sleep`) in its own network, UTS (hostname) and mount namespace (its /etc/hosts);
`Hosts.run` and `Hosts.popen` start commands on a host by entering the holder's namespaces. The hosts name
themselves as many cloud images do: a host's own name resolves to 127.0.0.1 there, so that a run across them
trains only where gptforge tells each node its address (`distributed.node_addrs` or the hostfile's addresses).
Their network is the veth pair alone: traffic stays between the two namespaces, which `close` deletes.

`ssh` on the hosts' PATH (a script in `bin`) is the system's client with this folder's key and no known-hosts
file: the node launcher and pdsh use it as they would a user's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

NAMES = ("node-a", "node-b")
ADDRS = ("10.91.0.1", "10.91.0.2")


def slurm_unavailable() -> str | None:
    """Why a Slurm cluster of the two hosts cannot be made here, or None."""
    for tool in ("slurmctld", "slurmd", "munged", "sbatch"):
        if not shutil.which(tool):
            return f"{tool} is not installed (.ci/run installs slurmctld, slurmd, slurm-client and munge as root)"
    return unavailable()


def unavailable() -> str | None:
    """Why two hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    packages = {"ip": "iproute2", "unshare": "util-linux", "nsenter": "util-linux", "/usr/sbin/sshd": "openssh-server",
                "ssh": "openssh-client", "ssh-keygen": "openssh-client"}
    for tool, package in packages.items():
        if not shutil.which(tool):
            return f"{tool} is not installed (Debian's {package}; .ci/run installs it as root)"
    probe = f"gfprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Hosts:
    """node-a (10.91.0.1) and node-b (10.91.0.2); `folder` holds their keys, configs and logs."""

    def __init__(self, folder: Path, loopback_names: bool = True):
        self.folder = folder
        self.bin = folder / "bin"
        self.netns = [f"gf{os.getpid()}{c}" for c in "ab"]
        self.holders: list[subprocess.Popen | None] = [None, None]
        self.sshds: list[subprocess.Popen | None] = [None, None]
        self.bin.mkdir(parents=True, exist_ok=True)
        key = folder / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        (folder / "authorized_keys").write_text((folder / "id_ed25519.pub").read_text())
        (folder / "ssh_config").write_text(
            f"Host *\n  IdentityFile {key}\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
            "  LogLevel ERROR\n  ConnectTimeout 10\n")
        ssh = self.bin / "ssh"
        ssh.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {folder / 'ssh_config'} \"$@\"\n")
        ssh.chmod(0o755)
        try:
            veth = f"gfv{os.getpid()}"
            for ns in self.netns:
                subprocess.run(["ip", "netns", "add", ns], check=True)
            subprocess.run(["ip", "link", "add", veth + "a", "type", "veth", "peer", "name", veth + "b"], check=True)
            for n, ns in enumerate(self.netns):
                dev = veth + "ab"[n]
                subprocess.run(["ip", "link", "set", dev, "netns", ns], check=True)
                for cmd in (["ip", "addr", "add", f"{ADDRS[n]}/24", "dev", dev], ["ip", "link", "set", dev, "up"],
                            ["ip", "link", "set", "lo", "up"]):
                    subprocess.run(["ip", "netns", "exec", ns, *cmd], check=True)
                etc = Path("/etc/netns") / ns
                etc.mkdir(parents=True, exist_ok=True)
                other = 1 - n
                # a cloud image's hosts file: its own name on the loopback address (or, `loopback_names` off, on
                # its address, as a cluster's DNS has it)
                own = (f"127.0.0.1 localhost {NAMES[n]}\n" if loopback_names
                       else f"127.0.0.1 localhost\n{ADDRS[n]} {NAMES[n]}\n")
                (etc / "hosts").write_text(f"{own}{ADDRS[other]} {NAMES[other]}\n")
                host = folder / f"host-{NAMES[n]}"
                host.mkdir(exist_ok=True)
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host / "host_key")],
                               check=True)
                (host / "sshd_config").write_text(
                    f"ListenAddress {ADDRS[n]}\nListenAddress 127.0.0.1\nHostKey {host / 'host_key'}\n"
                    f"PidFile {host / 'sshd.pid'}\nAuthorizedKeysFile {folder / 'authorized_keys'}\n"
                    "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                    "UsePAM no\nStrictModes no\nPrintMotd no\nMaxStartups 100\nMaxSessions 100\n"
                    f"SetEnv PATH={self.bin}:/usr/local/bin:/usr/bin:/bin\n")
            for n in range(2):
                self.boot(n)
        except BaseException:
            self.close()
            raise

    def boot(self, n: int) -> None:
        """Start host `n`: its holder (hostname, hosts file) and its sshd, listening once this returns."""
        ns, name = self.netns[n], NAMES[n]
        self.holders[n] = subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", f"hostname {name} && exec sleep infinity"],
            start_new_session=True)
        deadline = time.time() + 30
        while not self._entered(self.holders[n]):  # it named its host, then exec'd sleep
            assert self.holders[n].poll() is None and time.time() < deadline, f"{name}: its holder never started"
            time.sleep(0.05)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder (shared by both)
        host = self.folder / f"host-{name}"
        self.sshds[n] = self.popen(n, ["/usr/sbin/sshd", "-D", "-f", str(host / "sshd_config"), "-E",
                                       str(host / "sshd.log")])
        while self.run(n, ["ssh", "-o", "BatchMode=yes", name, "true"], check=False).returncode != 0:
            assert self.sshds[n].poll() is None, (host / "sshd.log").read_text()
            assert time.time() < deadline, f"{name}: sshd never answered"
            time.sleep(0.1)

    @staticmethod
    def _entered(holder: subprocess.Popen) -> bool:  # the holder has exec'd sleep (after naming its host)
        try:
            return Path(f"/proc/{holder.pid}/comm").read_text().strip() == "sleep"
        except OSError:
            return False

    def enter(self, n: int, cwd: str | Path | None = None) -> list[str]:
        """The prefix that runs a command on host `n`, in `cwd` (this process's folder by default)."""
        return ["nsenter", "-t", str(self.holders[n].pid), "-n", "-u", "-m", f"--wd={cwd or os.getcwd()}", "--"]

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment, `ssh` from `bin` first on the PATH, and `extra`."""
        return {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}", **extra}

    def run(self, n: int, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("check", True)
        kw.setdefault("env", self.env())
        return subprocess.run([*self.enter(n, kw.pop("cwd", None)), *cmd], capture_output=True, text=True, **kw)

    def popen(self, n: int, cmd: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("env", self.env())
        return subprocess.Popen([*self.enter(n, kw.pop("cwd", None)), *cmd], start_new_session=True, **kw)

    def pids(self, n: int) -> set[int]:
        """Every process on host `n` (its network namespace), but its holder and sshd."""
        out = subprocess.run(["ip", "netns", "pids", self.netns[n]], capture_output=True, text=True).stdout.split()
        keep = {p.pid for p in (self.holders[n], self.sshds[n]) if p is not None}
        return {int(p) for p in out} - keep

    def processes(self, n: int) -> list[str]:
        """The command lines of `pids(n)`, for a message."""
        lines = []
        for pid in sorted(self.pids(n)):
            try:
                lines.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                pass
        return lines

    def crash(self, n: int) -> None:
        """Host `n` goes down: every process on it killed at once, its sshd and holder too."""
        for pid in self.pids(n) | {p.pid for p in (self.holders[n], self.sshds[n]) if p is not None}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in (self.holders[n], self.sshds[n]):
            if p is not None:
                p.wait()
        self.holders[n] = self.sshds[n] = None

    def close(self) -> None:
        for n, ns in enumerate(self.netns):
            if self.holders[n] is not None:
                self.crash(n)
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # (its end of the veth pair with it)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


class Slurm:
    """A Slurm cluster of the two hosts (Debian's slurm-wlm): slurmctld on node-a, a slurmd on each, munge for
    their credentials (one munged a host, each its own socket). `env` is node-a's client environment (SLURM_CONF).

    Each slurmd runs in its host's network and UTS namespaces but the machine's mount namespace: slurmd 22.05
    always starts its cgroup plugin, which needs the machine's cgroup mounts (the hosts' own /sys hides them)."""

    def __init__(self, hosts: Hosts):
        self.hosts, self.procs = hosts, []
        d = self.folder = hosts.folder / "slurm"
        for sub in ("state", *(f"spool-{n}" for n in NAMES)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        # slurmd's cgroup plugin named, as its autodetection refuses a hybrid v1/v2 host (as this kind of machine is)
        v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        (d / "cgroup.conf").write_text(f"CgroupPlugin=cgroup/{'v2' if v2 else 'v1'}\n")
        nodes = "".join(f"NodeName={name} NodeAddr={addr} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN\n"
                        for name, addr in zip(NAMES, ADDRS))
        self.confs = []
        for n in range(2):
            conf = d / f"slurm-{NAMES[n]}.conf"
            conf.write_text(
                f"ClusterName=gptforge\nSlurmctldHost={NAMES[0]}({ADDRS[0]})\nAuthType=auth/munge\n"
                f"AuthInfo=socket={d}/munge-{n}.socket\nSlurmUser=root\nSlurmdUser=root\n"
                f"StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool-%n\nSlurmctldPidFile={d}/slurmctld.pid\n"
                f"SlurmdPidFile={d}/slurmd-%n.pid\nSlurmctldLogFile={d}/slurmctld.log\n"
                f"SlurmdLogFile={d}/slurmd-%n.log\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
                "SelectType=select/linear\nMpiDefault=none\nJobAcctGatherType=jobacct_gather/none\n"
                "AccountingStorageType=accounting_storage/none\nReturnToService=2\n"
                f"{nodes}PartitionName=all Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n")
            self.confs.append(conf)
        self.env = hosts.env(SLURM_CONF=str(self.confs[0]))
        try:
            for n in range(2):
                self.procs.append(hosts.popen(n, ["munged", "-F", "--force", f"--key-file={key}",
                                                  f"--socket={d}/munge-{n}.socket", f"--pid-file={d}/munged-{n}.pid",
                                                  f"--log-file={d}/munged-{n}.log", f"--seed-file={d}/munged-{n}.seed"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            deadline = time.time() + 30
            while not all((d / f"munge-{n}.socket").exists() for n in range(2)):
                assert time.time() < deadline, "munged never started"
                time.sleep(0.1)
            self.procs.append(hosts.popen(0, ["slurmctld", "-D", "-i"], env=self.env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            for n in range(2):
                self.procs.append(subprocess.Popen(
                    ["nsenter", "-t", str(hosts.holders[n].pid), "-n", "-u", "--", "slurmd", "-D", "-N", NAMES[n]],
                    env=hosts.env(SLURM_CONF=str(self.confs[n])), start_new_session=True,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            deadline = time.time() + 60
            while self.run(["sinfo", "-h", "-t", "idle", "-o", "%D"]).stdout.strip() != "2":
                assert time.time() < deadline, (d / "slurmctld.log").read_text()[-3000:]
                time.sleep(0.5)
        except BaseException:
            self.close()
            raise

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        """A Slurm client command on node-a."""
        return self.hosts.run(0, cmd, env=self.env, check=False, **kw)

    def close(self) -> None:
        for proc in reversed(self.procs):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        self.procs = []
