"""Past one machine: a real multi-node Ray cluster built from network namespaces (cluster/netns.py): a head node,
a prefill node and two decode nodes, each with its own address, pools placed by Ray resources as the chart's
worker groups place them. KV crosses nodes over NIXL/UCX on TCP; KV events cross to the router on the head;
a decode node killed outright is replaced on the other one. Needs root; skips with the reason elsewhere."""
from __future__ import annotations

import json
import textwrap

import pytest

from cluster.netns import NetnsCluster, unavailable
from engine import LLM, SamplingParams
from tests.conftest import CLUSTER_ENGINE

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(1500),
              pytest.mark.skipif(unavailable() is not None, reason=f"no network namespaces: {unavailable()}")]

PORT = 8751
HEAD, PREFILL_NODE, DECODE_NODE, SPARE_NODE = 0, 1, 2, 3
CONFIG = {
    "port": PORT, "ingress": {"num_cpus": 0},
    "prefill": {"num_cpus": 0, "resources": {"baton_pool_prefill": 1}, "engine": CLUSTER_ENGINE},
    "decode": {"num_cpus": 0, "resources": {"baton_pool_decode": 1}, "engine": CLUSTER_ENGINE},
    "disaggregation": {"min_remote_prefill_tokens": 16},
    "transfer": {"ucx_tls": "tcp"},          # across nodes: the network, not shared memory or cross-memory attach
}
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
out = {}
for a in state.actors(actor_state_name="ALIVE").values():
    for pool in ("prefill", "decode", "ingress"):
        if (a["Name"] or "").startswith(f"SERVE_REPLICA::baton#{pool}#"):
            out.setdefault(pool, []).append(a["Address"]["IPAddress"])
"""


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
    cluster = NetnsCluster(nodes=4, name="baton-test-mn", subnet="10.78.0", cpus_per_node=2,
                           resources={PREFILL_NODE: {"baton_pool_prefill": 1}, DECODE_NODE: {"baton_pool_decode": 1},
                                      SPARE_NODE: {"baton_pool_decode": 1}})
    cluster.up()
    try:
        on_head(cluster, f"""
            from cluster.config import ClusterConfig
            from cluster.serving import start
            start(ClusterConfig.from_dict({CONFIG!r}))
            out = True
        """, timeout=900)
        yield cluster
    finally:
        cluster.down()


def test_pools_on_their_nodes_serve_the_offline_text_with_kv_over_the_network(nodes):
    placement = on_head(nodes, PLACEMENT)
    assert placement["prefill"] == [nodes.ip(PREFILL_NODE)]
    assert placement["decode"][0] in (nodes.ip(DECODE_NODE), nodes.ip(SPARE_NODE))
    want = LLM(None, **CLUSTER_ENGINE).chat(PROMPT, SamplingParams(temperature=0, max_tokens=24)).text
    before = on_head(nodes, METRICS)
    assert chat(nodes)["text"] == want
    after = on_head(nodes, METRICS)
    pulled = total(after, "baton_kv_transfer_bytes_total", 'pool="decode"') - \
        total(before, "baton_kv_transfer_bytes_total", 'pool="decode"')
    assert pulled > 0, "the prompt's KV went from the prefill node to the decode node"
    # the same prompt again: the router on the head predicts what the chosen replica caches from the KV events
    # its node sent (the decode replica now holds the prompt, so it may prefill the rest itself)
    assert chat(nodes)["text"] == want
    again = on_head(nodes, METRICS)
    exact = total(again, "baton_router_cache_predictions_total", 'outcome="exact"') - \
        total(after, "baton_router_cache_predictions_total", 'outcome="exact"')
    predicted = total(again, "baton_router_predicted_cached_tokens_sum") - \
        total(after, "baton_router_predicted_cached_tokens_sum")
    assert exact >= 1 and predicted > 0, "the index on the head knows what the other nodes cache"


def test_a_decode_node_killed_outright_is_replaced_on_the_other(nodes):
    placement = on_head(nodes, PLACEMENT)
    (ip,) = placement["decode"]
    victim = DECODE_NODE if ip == nodes.ip(DECODE_NODE) else SPARE_NODE
    other = SPARE_NODE if victim == DECODE_NODE else DECODE_NODE
    assert nodes.kill_node(victim) > 0
    nodes.wait_nodes(3)
    out = chat(nodes, retry_s=300)
    assert "text" in out, out
    assert on_head(nodes, PLACEMENT)["decode"] == [nodes.ip(other)]
