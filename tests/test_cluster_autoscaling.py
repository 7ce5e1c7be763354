"""Autoscaling on a local Ray cluster: a CPU decode pool grows 1 -> 2 under streaming load and shrinks back to 1
after it, driven by the replicas' own signals through Serve's application-level (coupled) policy. Every stream
finishes with its tokens (a replica being removed drains first), and /metrics shows the decisions."""
from __future__ import annotations

import threading
import time
import urllib.request

import openai
import pytest
from ray import serve

from tests.conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PORT = 8736
MODEL = "SmolLM2-135M-Instruct"
ENGINE = {"kv_cache_memory": 64 << 20, "max_model_len": 1024, "max_num_seqs": 8}
FAST = {"look_back_period_s": 2, "metrics_interval_s": 0.5, "cooldown_s": 3}


AUTOSCALING = {
    "port": PORT, "ingress": {"num_cpus": 0},
    "prefill": {"num_cpus": 0, "engine": ENGINE,
                "autoscaling": {"min_replicas": 1, "max_replicas": 1, "ttft_slo_s": 0, **FAST}},
    "decode": {"num_cpus": 0, "engine": ENGINE, "graceful_shutdown_timeout_s": 60,
               "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_running_seqs": 2, "itl_slo_s": 0,
                               "upscale_delay_s": 1, "downscale_delay_s": 4, **FAST}}}


@pytest.fixture
def client(shared_cluster):
    shared_cluster.up(AUTOSCALING)
    return openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=300)


def running(deployment: str) -> int:
    d = serve.status().applications["baton"].deployments[deployment]
    return d.replica_states.get("RUNNING", 0)


def waited(cond, timeout_s: float, what: str) -> float:
    """Seconds until cond() held (wait_for fails past timeout_s)."""
    t0 = time.monotonic()
    wait_for(cond, timeout_s, what, interval_s=0.5)
    return time.monotonic() - t0


def test_decode_pool_scales_up_under_load_and_back_down_after_it(client):
    assert running("decode") == 1
    done, errors, stop = [], [], threading.Event()

    def user(i: int) -> None:
        while not stop.is_set():
            try:
                stream = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Tell story number {i} about relays."}],
                    max_tokens=96, temperature=0, stream=True, extra_body={"ignore_eos": True})
                chunks = [c for c in stream]
                done.append(sum(len(c.choices[0].delta.content or "") > 0 for c in chunks if c.choices))
            except Exception as e:             # noqa: BLE001 - every failure is reported below
                errors.append(repr(e))

    users = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(6)]
    for u in users:
        u.start()
    try:
        up_after = waited(lambda: running("decode") == 2, 240, "the decode pool to reach 2 replicas")
        waited(lambda: len(done) >= 6, 240, "streams to finish after the scale-up")   # the pool serves on
    finally:
        stop.set()
        for u in users:
            u.join(timeout=300)
    assert not errors, errors[:3]
    assert all(n > 50 for n in done)                        # every stream got its tokens, none was cut
    down_after = waited(lambda: running("decode") == 1, 180, "the decode pool to shrink back to 1")

    def metrics() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=30).read().decode()

    down = 'baton_autoscaling_decisions_total{direction="down",pool="decode"'
    waited(lambda: down in metrics(), 30, "the scale-down decision in /metrics")   # exported about once a second
    text = metrics()
    assert 'baton_autoscaling_decisions_total{direction="up",pool="decode",reason="running_seqs"}' in text
    assert 'baton_autoscaling_target_replicas{pool="decode"} 1.0' in text
    assert running("prefill") == 1                          # its max, held however the coupling pulls
    # the scale-down's choice: the policy wrapped Serve's replica choice in the controller and feeds it each
    # replica's tokens in flight (tests/test_autoscaling.py checks the ranking against Serve's own class)
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    def move_costs(_controller) -> dict:
        from ray.serve._private.deployment_scheduler import DeploymentScheduler
        costs = getattr(DeploymentScheduler, "_baton_move_costs", {})
        return {dep.name: {r.unique_id: v for r, v in by.items()} for dep, by in costs.items()}
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    costs = ray.get(controller.__ray_call__.remote(move_costs))
    assert {"prefill", "decode"} <= set(costs) and costs["decode"], costs
    print(f"scaled up {up_after:.1f} s into the load, down {down_after:.1f} s after it; {len(done)} streams")


def test_deleting_an_app_leaves_no_actor_of_it_behind(client):
    """Under `serve deploy` or KubeRay the app is all there is: its state actor must end with it (a detached one
    would outlive it). A second, colocated app on the same Ray cluster, then serve.delete."""
    import ray

    from cluster.app import build_app
    from cluster.config import ClusterConfig
    from replica.names import STATE_NAMESPACE, get_state_actor, state_actor_name
    app = "lifecycle"
    config = ClusterConfig.from_dict({"mode": "colocated", "decode": {"num_cpus": 0, "engine": ENGINE}})
    serve.run(build_app(config, app), name=app, route_prefix=f"/{app}")

    def actors_of_app() -> list[str]:       # named actors, from the GCS (this local Ray has no dashboard)
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"] == state_actor_name(app) or a["name"].startswith(f"SERVE_REPLICA::{app}#")]

    assert ray.get(get_state_actor(state_actor_name(app)).stale.remote()) == {"prefill": [], "decode": []}
    assert {a for a in actors_of_app() if not a.startswith("SERVE_REPLICA")} == {state_actor_name(app)}
    serve.delete(app)
    wait_for(lambda: not actors_of_app(), 60, f"the actors of app {app} to end")
    with pytest.raises(ValueError):
        ray.get_actor(state_actor_name(app), namespace=STATE_NAMESPACE)
    assert get_state_actor(state_actor_name("baton"))        # the other app's is untouched


def test_a_state_actor_that_ends_is_replaced_and_every_replica_reports_to_its_successor(client):
    """The cluster state actor ends with the state replica that owns it (a node drain moves that replica). Here
    it is killed outright: the owner starts a successor at the next call, every replica registers with it and
    resyncs, and /metrics shows both pools again; requests are served throughout."""
    import ray

    from replica.names import get_state_actor, state_actor_name

    def pools_reporting() -> set[str]:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=30).read().decode()
        except Exception:                     # noqa: BLE001 - the call that finds the actor gone may fail
            return set()
        lines = [line for line in text.splitlines() if line.startswith("baton_kv_blocks_total{")]
        return {p for p in ("prefill", "decode") if any(f'pool="{p}"' in line for line in lines)}
    assert pools_reporting() == {"prefill", "decode"}
    old = get_state_actor(state_actor_name("baton"))
    ray.kill(old, no_restart=True)
    wait_for(lambda: pools_reporting() == {"prefill", "decode"}, 60, "both pools reporting to a new state actor")
    assert get_state_actor(state_actor_name("baton"))._actor_id != old._actor_id
    out = client.completions.create(model=MODEL, prompt="After the state actor", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4
