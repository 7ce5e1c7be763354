"""Past one machine: a real multi-node Ray cluster built from network namespaces (cluster/netns.py): a head node,
a prefill node, a decode node and a spare that can take either pool, each with its own address, pools placed by
Ray resources as the chart's worker groups place them. KV crosses nodes over NIXL/UCX on TCP; KV events cross to
the router on the head; a decode node killed outright (the ingress with it), and the prefill node's raylet killed
alone, each have their replicas replaced on the spare; then the node holding the decode pool (the spare, holding
everything, after the kill tests) is drained under load and its replicas move to the other nodes without a failed
stream. Needs root; skips with the reason elsewhere."""
from __future__ import annotations

import json
import textwrap

import pytest

from cluster.netns import NetnsCluster, unavailable
from engine import LLM, SamplingParams
from tests.conftest import CLUSTER_ENGINE, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(1500),
              pytest.mark.skipif(unavailable() is not None, reason=f"no network namespaces: {unavailable()}")]

PORT = 8751
HEAD, PREFILL_NODE, DECODE_NODE, SPARE_NODE = 0, 1, 2, 3    # the spare joins after the app starts: see `nodes`
CONFIG = {
    # the ingress goes where decode replicas may go (the decode node, later the spare): the kill and drain tests
    # move it too, and the drain test's streams live in the ingress replica that the drain stops
    "port": PORT, "ingress": {"num_cpus": 0, "resources": {"baton_ingress": 1}},
    "prefill": {"num_cpus": 0, "resources": {"baton_pool_prefill": 1}, "engine": CLUSTER_ENGINE},
    "decode": {"num_cpus": 0, "resources": {"baton_pool_decode": 1}, "engine": CLUSTER_ENGINE},
    "disaggregation": {"min_remote_prefill_tokens": 16},
    "transfer": {"ucx_tls": "tcp"},          # across nodes: the network, not shared memory or cross-memory attach
}
# the head declares a node dead after 5 failed health checks: 1 s apart here, not 3 (each kill test waits for it)
FAST_DEATH = {"RAY_health_check_period_ms": "1000"}
PROMPT = [{"role": "user", "content": "Name three things a relay team practises before a race."}]


def on_head(cluster: NetnsCluster, body: str, timeout: float = 600) -> dict:
    """Run `body` (Python that sets `out`) in the head node's namespace; its `out` as JSON."""
    code = "import json\n" + textwrap.dedent(body) + "\nprint('OUT' + json.dumps(out))"
    res = cluster.python(code, timeout=timeout)
    lines = [x for x in res.stdout.splitlines() if x.startswith("OUT")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    return json.loads(lines[-1][3:])


def chat(cluster: NetnsCluster, retry_s: float = 0.0) -> dict:
    """One greedy chat completion through the head's HTTP proxy with the openai client, retried for `retry_s`
    (while a replacement replica starts); {"text"} or {"error"}."""
    return on_head(cluster, f"""
        import time, openai
        c = openai.OpenAI(base_url="http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=300)
        deadline, out = time.monotonic() + {retry_s}, None
        while out is None:
            try:
                r = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages={PROMPT!r}, temperature=0,
                                              max_tokens=24)
                out = {{"text": r.choices[0].message.content}}
            except Exception as e:
                if time.monotonic() > deadline:
                    out = {{"error": repr(e)}}
                else:
                    time.sleep(2)
    """)


METRICS = f"""
import urllib.request
out = {{}}
for line in urllib.request.urlopen("http://127.0.0.1:{PORT}/metrics", timeout=30).read().decode().splitlines():
    if line and not line.startswith("#"):
        k, v = line.rsplit(" ", 1)
        out[k] = float(v)
"""
PLACEMENT = """
import ray
from ray._private import state       # the GCS's actor table (the public state API needs the dashboard)
ray.init()

def placement() -> dict:
    out = {}
    for a in state.actors(actor_state_name="ALIVE").values():
        for pool in ("prefill", "decode", "ingress"):
            if (a["Name"] or "").startswith(f"SERVE_REPLICA::baton#{pool}#"):
                out.setdefault(pool, []).append(a["Address"]["IPAddress"])
    return out
out = placement()
"""


def replaced(cluster: NetnsCluster, pool: str, ip: str | None = None, off: str | None = None,
             timeout_s: float = 300) -> None:
    """Until the pool's one replica runs on `ip` (or anywhere but `off`) and every deployment is healthy, all its
    replicas running (a replica still starting when the test ends would be killed by the teardown)."""
    out = on_head(cluster, PLACEMENT + f"""
import time
from ray import serve
deadline = time.monotonic() + {timeout_s}
while True:
    deployments = serve.status().applications["baton"].deployments
    out = {{"placed": placement(), "replicas": {{k: d.replica_states for k, d in deployments.items()}}}}
    where = out["placed"].get({pool!r}, [])
    if len(where) == 1 and where[0] == ({ip!r} or where[0]) and where[0] != {off!r} and \
            all(d.status == "HEALTHY" and set(d.replica_states) == {{"RUNNING"}} for d in deployments.values()):
        break
    if time.monotonic() > deadline:
        out["timeout"] = True
        break
    time.sleep(1)
""", timeout=timeout_s + 120)
    assert "timeout" not in out, f"{pool} not replaced on {ip or 'a node other than ' + str(off)}: {out}"


def total(m: dict, metric: str, *labels: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(metric + "{") and all(x in k for x in labels))


def test_baton_dev_cluster_builds_and_removes_a_multi_node_cluster():
    import subprocess
    import sys

    from tests.conftest import ROOT
    name = "baton-test-cli"

    def baton(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli.main", "dev", "cluster", "--name", name, *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
    res = baton("--nodes", "2")
    try:
        assert res.returncode == 0, res.stderr[-3000:]
        assert "node 1: namespace baton-test-cli-n1, address 10.77.0.2" in res.stdout
        NetnsCluster(nodes=2, name=name).wait_nodes(2, timeout_s=30)
    finally:
        down = baton("--down")
    assert down.returncode == 0, down.stderr[-2000:]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in listed


@pytest.fixture(scope="module")
def nodes():
    """The spare node, which has both pools' resources, joins once the app runs: the pools start on their own
    nodes, and each kill test (in either order) has a node to move its pool to."""
    cluster = NetnsCluster(nodes=4, name="baton-test-mn", subnet="10.78.0", cpus_per_node=2, env=FAST_DEATH,
                           resources={PREFILL_NODE: {"baton_pool_prefill": 1},
                                      DECODE_NODE: {"baton_pool_decode": 1, "baton_ingress": 1},
                                      SPARE_NODE: {"baton_pool_prefill": 1, "baton_pool_decode": 1,
                                                   "baton_ingress": 1}})
    cluster.up(ray_nodes=SPARE_NODE)
    try:
        on_head(cluster, f"""
            from cluster.config import ClusterConfig
            from cluster.serving import start
            start(ClusterConfig.from_dict({CONFIG!r}))
            out = True
        """, timeout=900)
        cluster.start_node(SPARE_NODE)
        cluster.wait_nodes(SPARE_NODE + 1)
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(None, **CLUSTER_ENGINE)


@pytest.fixture(scope="module")
def offline_text(reference) -> str:
    return reference.chat(PROMPT, SamplingParams(temperature=0, max_tokens=24)).text


def test_pools_on_their_nodes_serve_the_offline_text_with_kv_over_the_network(nodes, offline_text):
    placement = on_head(nodes, PLACEMENT)
    assert placement["prefill"] == [nodes.ip(PREFILL_NODE)]
    assert placement["decode"] == placement["ingress"] == [nodes.ip(DECODE_NODE)]
    before = on_head(nodes, METRICS)
    assert chat(nodes)["text"] == offline_text

    def pulled() -> dict | None:          # replicas report their metrics every half second: wait for the pull's
        m = on_head(nodes, METRICS)
        grew = total(m, "baton_kv_transfer_bytes_total", 'pool="decode"') - \
            total(before, "baton_kv_transfer_bytes_total", 'pool="decode"')
        return m if grew > 0 else None
    after = wait_for(pulled, 20, "the decode node's metrics to show the prompt's KV pulled from the prefill node",
                     interval_s=1.0)
    # the same prompt again: the router on the head predicts what the chosen replica caches from the KV events
    # its node sent (the decode replica now holds the prompt, so it may prefill the rest itself)
    assert chat(nodes)["text"] == offline_text
    again = on_head(nodes, METRICS)
    exact = total(again, "baton_router_cache_predictions_total", 'outcome="exact"') - \
        total(after, "baton_router_cache_predictions_total", 'outcome="exact"')
    predicted = total(again, "baton_router_predicted_cached_tokens_sum") - \
        total(after, "baton_router_predicted_cached_tokens_sum")
    assert exact >= 1 and predicted > 0, "the index on the head knows what the other nodes cache"


def test_a_decode_node_killed_outright_is_replaced_on_the_spare(nodes, offline_text):
    assert on_head(nodes, PLACEMENT)["decode"] == [nodes.ip(DECODE_NODE)]
    alive = nodes.alive()
    assert nodes.kill_node(DECODE_NODE) > 0
    nodes.wait_nodes(alive - 1)
    replaced(nodes, "decode", nodes.ip(SPARE_NODE))
    replaced(nodes, "ingress", nodes.ip(SPARE_NODE))
    assert chat(nodes, retry_s=60) == {"text": offline_text}


def test_a_raylet_killed_alone_has_its_nodes_replicas_replaced_on_the_spare(nodes, offline_text):
    """Only the prefill node's raylet dies: the node's workers (its replicas among them) exit with it, the head
    declares the node dead, and Serve starts the prefill replica again on the spare."""
    assert on_head(nodes, PLACEMENT)["prefill"] == [nodes.ip(PREFILL_NODE)]
    alive = nodes.alive()
    nodes.kill_raylet(PREFILL_NODE)
    nodes.wait_nodes(alive - 1)
    wait_for(lambda: not [c for c in nodes.processes(PREFILL_NODE).values() if c.startswith("ray::ServeReplica")],
             60, "the dead node's replica processes to exit")
    replaced(nodes, "prefill", nodes.ip(SPARE_NODE))
    assert chat(nodes, retry_s=60) == {"text": offline_text}


def test_a_node_drained_under_load_moves_its_replicas_and_fails_no_stream(nodes, reference):
    """A Kubernetes node drain as KubeRay's autoscaler (v2) and spot preemption ask for it: the GCS is told to
    drain the node (`ray drain-node`, the call autoscaler v2 makes). Serve marks the node's replicas for
    migration, starts successors on other nodes and then stops the old ones gracefully; the decode replica hands
    its streams over as soon as it is marked (they wait for the successor and continue there, by KV pull or
    replay), the prefill replica finishes what it holds, and the ingress replica (placed with the decode replica
    here) finishes the streams it holds, which may wait for the decode successor first: a drained ingress stopped
    after Serve's default 20 s cut them on a slow machine. Users stream all along: none fails, and every text is
    the offline engine's. (While the successors start, admission control may refuse a new request with a 429
    before any token, as it should under that load; the users retry after its Retry-After, as clients do.)
    Whatever the tests before it left (run after the kill tests, both pools are on the spare), every worker node
    runs first, then the node holding the decode replica is drained: its replicas move to the others."""
    placed = on_head(nodes, PLACEMENT)
    drained = placed["decode"][0]
    assert placed["ingress"] == [drained]           # its streams' HTTP side moves too
    alive = nodes.alive()
    down = [node for node in (PREFILL_NODE, DECODE_NODE, SPARE_NODE)      # a kill test's node: no raylet left
            if not any(c.split()[0].endswith("raylet") for c in nodes.processes(node).values() if c)]
    for node in down:
        nodes.start_node(node)
    nodes.wait_nodes(alive + len(down))
    expected = reference.chat(PROMPT, SamplingParams(temperature=0, max_tokens=64)).text
    out = on_head(nodes, f"""
        import subprocess, threading, time, urllib.request
        import openai, ray
        ray.init()
        drained = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == {drained!r})

        def moves() -> float:
            # NaN while /metrics cannot answer: the drain may move the state replica too (then its actor is
            # replaced, and the replicas report to the new one); the streams are what this test holds
            try:
                text = urllib.request.urlopen("http://127.0.0.1:{PORT}/metrics", timeout=30).read().decode()
            except Exception:
                return float("nan")
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("baton_request_moves_total{{") and 'reason="drain"' in line)

        def wait(condition, timeout_s):
            deadline = time.monotonic() + timeout_s
            while not condition() and time.monotonic() < deadline:
                time.sleep(0.5)
            return condition()

        client = openai.OpenAI(base_url="http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)
        texts, errors, refused, stop = [], [], [], threading.Event()

        def user():
            while not stop.is_set():
                try:
                    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages={PROMPT!r},
                                                            temperature=0, max_tokens=64, stream=True)
                    texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
                except openai.RateLimitError as e:      # admission refused it, before any token: retry later
                    refused.append(e.response.headers.get("retry-after"))
                    stop.wait(float(e.response.headers.get("retry-after") or 1))
                except Exception as e:
                    errors.append(repr(e))
        users = [threading.Thread(target=user, daemon=True) for _ in range(4)]
        for u in users:
            u.start()
        try:
            warm = wait(lambda: len(texts) >= 4, 120)
            m0 = moves()
            assert m0 == m0, "/metrics answers before the drain"
            drain = subprocess.run(["ray", "drain-node", "--node-id", drained, "--reason",
                                    "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "kubectl drain",
                                    "--deadline-remaining-seconds", "600"], capture_output=True, text=True)
            moved = wait(lambda: moves() > m0, 180)
            n = len(texts)
            served_after = wait(lambda: len(texts) >= n + 4, 180)     # the successors serve on
        finally:
            stop.set()
        for u in users:
            u.join(120)
        out = {{"warm": warm, "drain": [drain.returncode, drain.stdout[-500:], drain.stderr[-1500:]],
               "moved": moved, "moves": moves() - m0, "served_after": served_after, "errors": errors[:5],
               "refused": len(refused),
               "texts": sorted(set(texts)), "count": len(texts)}}
    """, timeout=900)
    assert out["drain"][0] == 0, out["drain"]
    assert out["warm"] and out["moved"] and out["served_after"], out
    assert out["errors"] == [], out["errors"]
    assert out["texts"] == [expected], out["texts"]           # every stream, moved or not, is the offline text
    replaced(nodes, "decode", off=drained)
    replaced(nodes, "ingress", off=drained)
    if placed["prefill"] == [drained]:
        replaced(nodes, "prefill", off=drained)
    assert chat(nodes) == {"text": reference.chat(PROMPT, SamplingParams(temperature=0, max_tokens=24)).text}
    # /metrics shows one replica per pool again: the successors report (to a new state actor if the drain
    # moved the state replica too) and the drained replicas' entries are gone

    def reporting() -> dict[str, int]:
        keys = [k for k in on_head(nodes, METRICS) if k.startswith("baton_kv_blocks_total{")]
        return {pool: sum(f'pool="{pool}"' in k for k in keys) for pool in ("prefill", "decode")}
    wait_for(lambda: reporting() == {"prefill": 1, "decode": 1}, 90, "one replica per pool in /metrics")
