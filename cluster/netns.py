"""A multi-node Ray cluster on one machine: one network namespace per node, each with its own address, joined
by veth pairs to a bridge that lives in a namespace of its own (tests, `baton dev cluster --nodes N`).

    <name>-sw    bridge br0, one veth end per node              (traffic stays inside these namespaces)
    <name>-n0    eth0 10.77.0.1   `ray start --head`             resources {"baton_node_0": 1}
    <name>-n1    eth0 10.77.0.2   `ray start --address ...`      resources {"baton_node_1": 1}
    ...

Nothing touches the host's own interfaces or routes: every link is created inside the namespaces, and the
host namespace has no address on the subnet, so a process must run inside a node's namespace
(`exec`, `python`) to reach the cluster. Each node's processes are found by their namespace
(`ip netns pids`), so `kill_node`, `kill_raylet` and `down` end exactly this cluster's processes, never another
Ray on the machine (`ray stop` would stop them all). Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and `ip`.

Pools go to nodes by Ray resources, as the Helm chart's worker groups do: a pool's `resources:
{baton_node_1: 1}` puts its replicas on node 1. KV crosses nodes over NIXL/UCX on TCP between the namespaces
(`transfer.ucx_tls: tcp`; on a real cluster with RDMA NICs leave it unset, or name the RDMA transports,
e.g. `rc,ud,self`, and UCX_NET_DEVICES the NIC).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster.serving import serve_env

ROOT = str(Path(__file__).resolve().parents[1])
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def unavailable() -> str | None:
    """Why a namespace cluster cannot be built here, or None if it can."""
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"baton-probe-{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"`ip netns add` fails here: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class NetnsCluster:
    nodes: int = 3
    name: str = "baton-mn"
    subnet: str = "10.77.0"              # node i is <subnet>.(i + 1)/24
    port: int = 6379
    cpus_per_node: int = 2
    env: dict[str, str] = field(default_factory=dict)   # extra environment of every node's Ray processes
    resources: dict[int, dict[str, float]] = field(default_factory=dict)   # node -> more custom resources
    temp_dir: str = ""                   # Ray's; default /tmp/<name>, so `down` of one cluster spares another's

    def __post_init__(self):
        self.temp_dir = self.temp_dir or f"/tmp/{self.name}"

    def ns(self, i: int) -> str:
        return f"{self.name}-n{i}"

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def address(self) -> str:
        return f"{self.ip(0)}:{self.port}"

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    # -- lifecycle ----------------------------------------------------------------------------------
    def up(self, ray_nodes: int | None = None) -> NetnsCluster:
        """Namespaces, links and addresses, then a Ray node in the first `ray_nodes` of them (default all; head
        first); returns once they have joined. `start_node` starts the others later. Leftovers of an earlier run
        under the same name are removed first."""
        why = unavailable()
        if why:
            raise RuntimeError(why)
        self.down()
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, veth = self.ns(i), f"v{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "netns", self.switch, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", veth, "master", "br0")
            _ip("-n", self.switch, "link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        Path(self.temp_dir).mkdir(parents=True, exist_ok=True)
        ray_nodes = self.nodes if ray_nodes is None else ray_nodes
        try:
            for i in range(ray_nodes):
                self.start_node(i)
            self.wait_nodes(ray_nodes)
        except BaseException:
            self.down()
            raise
        return self

    def start_node(self, i: int) -> None:
        """`ray start` in node i's namespace (the head's for i = 0); `wait_nodes` until it has joined."""
        resources = json.dumps({f"baton_node_{i}": 1, **self.resources.get(i, {})})
        common = ["--node-ip-address", self.ip(i), "--num-cpus", str(self.cpus_per_node),
                  "--resources", resources, "--disable-usage-stats"]
        if i == 0:
            argv = ["ray", "start", "--head", "--port", str(self.port), "--include-dashboard=false",
                    "--temp-dir", self.temp_dir, *common]
        else:
            argv = ["ray", "start", "--address", self.address, "--temp-dir", self.temp_dir, *common]
        res = self.exec(i, argv, timeout=180)
        if res.returncode != 0:
            raise RuntimeError(f"ray start on {self.ns(i)} failed: {res.stderr[-2000:]}")

    def wait_nodes(self, n: int, timeout_s: float = 120) -> None:
        """Until exactly `n` nodes are alive (after a start, or after kill_node or kill_raylet)."""
        deadline = time.monotonic() + timeout_s
        while True:
            res = self._count_alive()
            if res.returncode == 0 and res.stdout.strip().splitlines()[-1] == str(n):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} Ray nodes not alive after {timeout_s:.0f} s: {res.stdout[-300:]} "
                                   f"{res.stderr[-1500:]}")
            time.sleep(1.0)

    def alive(self) -> int:
        """How many nodes the head counts alive."""
        res = self._count_alive()
        if res.returncode != 0:
            raise RuntimeError(f"the head did not answer: {res.stderr[-1500:]}")
        return int(res.stdout.strip().splitlines()[-1])

    def _count_alive(self) -> subprocess.CompletedProcess:
        return self.python("import ray; ray.init(); print(sum(x['Alive'] for x in ray.nodes()))", timeout=60)

    def kill_node(self, i: int) -> int:
        """SIGKILL every process of node i (its raylet, workers and replicas): a node that dies at once."""
        return _kill_all(self.ns(i))

    def kill_raylet(self, i: int) -> int:
        """SIGKILL node i's raylet alone, and return its pid: the node's workers and agents are left to notice
        on their own, as when a raylet crashes."""
        pids = [p for p in _pids(self.ns(i)) if _comm(p) == "raylet"]
        if len(pids) != 1:
            raise RuntimeError(f"{self.ns(i)}: expected one raylet, found pids {pids}")
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]

    def processes(self, i: int) -> dict[int, str]:
        """Node i's processes: pid -> command line (a Ray worker's names its actor, `ray::ServeReplica:...`)."""
        out = {}
        for pid in _pids(self.ns(i)):
            try:
                out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:                       # exited meanwhile
                pass
        return out

    def down(self) -> None:
        """Kill every process in the node namespaces, delete the namespaces (their links go with them)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        mine = [line.split()[0] for line in listed.splitlines()
                if line.split() and line.split()[0].startswith(f"{self.name}-")]
        for ns in mine:
            _kill_all(ns)
        for ns in mine:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    # -- running things on a node ---------------------------------------------------------------------
    def node_env(self, i: int = 0) -> dict[str, str]:
        bin_dir = os.path.dirname(sys.executable)
        return {**os.environ, **serve_env(), **RAY_ENV, **self.env, "RAY_ADDRESS": self.address, "PYTHONPATH": ROOT,
                "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}

    def exec(self, i: int, argv: list[str], timeout: float | None = None, **kw) -> subprocess.CompletedProcess:
        """`argv` in node i's namespace; its stdout and stderr captured unless `kw` says otherwise (stderr=None:
        to this process's stderr)."""
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kw}
        return subprocess.run(["ip", "netns", "exec", self.ns(i), *argv], text=True, env=self.node_env(i),
                              cwd=ROOT, timeout=timeout, **pipes)

    def python(self, code: str, node: int = 0, timeout: float | None = 600) -> subprocess.CompletedProcess:
        """`python -c code` inside node `node`'s namespace, with RAY_ADDRESS set to the head."""
        return self.exec(node, [sys.executable, "-c", code], timeout=timeout)


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")


def _pids(ns: str) -> list[int]:
    return [int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]


def _comm(pid: int) -> str:
    """A process's name (the kernel's, e.g. `raylet`), or "" once it has exited."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _kill_all(ns: str) -> int:
    pids = _pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)
