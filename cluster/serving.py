"""Starting and stopping the app on a local or existing Ray cluster (`baton serve`, tests, benchmarks)."""
from __future__ import annotations

import logging
import os
import time

from cluster.config import ClusterConfig
from replica.names import POOLS

log = logging.getLogger(__name__)

# Ray Serve's throughput-optimized mode (Ray's guide "Enable High Throughput on Ray Serve"; what the flag sets is in
# ray/serve/_private/constants.py): user code and the handle's router run on the replica's own event loop, not a
# thread of their own each (a thread hop per streamed delta), deployments call each other over gRPC, and the
# garbage collector is frozen after start-up; Serve's HTTP proxy also reaches the ingress over gRPC (the mode
# leaves that to RAY_SERVE_PROXY_USE_GRPC, which Serve reads before the flag). Two of its parts stay off here.
# Direct ingress serves each ingress replica on a port of its own for HAProxy or a cloud load balancer in front;
# without one it leaves Serve's proxy on the head node only and holds every ingress replica 30 s as it stops.
# And replicas keep logging to stderr, as `ray logs` and the driver show it. Two of Serve's timers run slower
# than its defaults: the controller's loop every 0.5 s instead of 0.1 (each pass asks the GCS for every node's
# resources), and each replica's export of Serve's own metrics every second instead of 100 ms (Prometheus scrapes
# every few seconds). On a small host each of their wake-ups takes a core from an engine whose OpenMP team then
# waits for it: with both, and the decode replica reading its own stop in-process, an idle 2-core cluster used
# 0.23 cores instead of 0.30 and 16 streams ran 15-20% faster (docs/benchmarks.md, 2026-11-29). Serve reacts
# to a replica's start, death or an autoscaling decision up to 0.4 s later. Every process of the cluster reads
# these at start: a local Ray started by init_ray takes them from this process's environment, `ray start` (the
# namespace cluster) and the chart's pods from theirs. RAY_SERVE_THROUGHPUT_OPTIMIZED=0 in the environment turns
# the mode off.
SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_PROXY_USE_GRPC": "1",
             "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_SERVE_LOG_TO_STDERR": "1",
             "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}


def serve_env() -> dict[str, str]:
    """SERVE_ENV, where the environment does not set a value of its own."""
    return {k: os.environ.get(k, v) for k, v in SERVE_ENV.items()}


def init_ray(**kwargs):
    """ray.init(**kwargs), tried a second time when Ray's own start-up times out. On a loaded 2-core machine a
    local node's raylet has failed to register in Ray's fixed 30 s without writing a line of its log (twice in
    some thirty suite runs, 2026-11), and a GCS has failed to publish its port in two minutes without writing one
    either (twice in one suite run, 2026-11-27: "Timed out waiting for file .../gcs_server_port_..."). The
    raylet's next start went through; the GCS's is retried the same way.

    A local start runs Serve in its throughput-optimized mode (SERVE_ENV): the raylet, and so every worker,
    inherits this process's environment."""
    import ray
    if kwargs.get("address") in (None, "local"):
        os.environ.update(serve_env())
    try:
        return ray.init(**kwargs)
    except Exception as e:                  # noqa: BLE001 - Ray raises a bare Exception for it
        if "timed out" not in str(e).lower() or kwargs.get("address") not in (None, "local"):
            raise
        log.warning("Ray did not start (%s); starting it again", e)
        ray.shutdown()
        return ray.init(**kwargs)


def start(config: ClusterConfig, num_cpus: int | None = None):
    """Deploy serve_config(config), as `serve deploy` would, and return the ingress handle. Starts a local Ray
    unless one is reachable."""
    import ray
    from ray import serve

    from cluster.app import APP_NAME, serve_config
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if num_cpus is None and address is None:   # a local Ray: room for every replica's logical CPUs
            num_cpus = max(os.cpu_count() or 1, int(-(-_cpus_needed(config) // 1)))
        init_ray(address=address, num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING",
                 namespace="baton")
    serve.start(http_options={"host": config.host, "port": config.port})
    _deploy_apps(serve_config(config, APP_NAME))
    return _wait_running(APP_NAME)


def redeploy(config: ClusterConfig, app_name: str, timeout_s: float = 600):
    """Deploy an edited config over the running app (Serve replaces only the deployments that changed) and
    wait until it runs again: the app RUNNING, and each pool of a fixed size running exactly that many
    replicas, none starting or stopping. The app's status alone is not enough: the controller records the new
    config at once but acts on it in its next loop, so for a moment the old RUNNING stands beside it (a test
    that grew the decode pool then found the new replica still loading its model, 2026-11-27)."""
    from ray import serve

    from cluster.app import serve_config
    before = serve.status().applications[app_name].last_deployed_time_s
    _deploy_apps(serve_config(config, app_name))
    deadline = time.monotonic() + 60              # the old status stands until the controller takes the new config
    while serve.status().applications[app_name].last_deployed_time_s == before:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve did not take the new config of {app_name} in 60 s")
        time.sleep(0.05)
    fixed = {name: pool.num_replicas for name in POOLS if (pool := getattr(config, name)) is not None
             and pool.autoscaling is None}
    deadline = time.monotonic() + timeout_s
    while True:
        handle = _wait_running(app_name, max(deadline - time.monotonic(), 1.0))
        states = replica_states(app_name, fixed)
        if all(s == {"RUNNING": fixed[name]} for name, s in states.items()):
            return handle
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve application {app_name}: pools not at their size after {timeout_s:.0f} s "
                               f"(want {fixed}, have {states})")
        time.sleep(0.2)


def replica_states(app_name: str, deployments) -> dict[str, dict[str, int]]:
    """Serve's count of replicas in each state (RUNNING, STARTING, STOPPING, ...) for these deployments of the
    app; {} for one it does not have. A pool is whole when its only state is RUNNING: a replica's actor exists
    while it still loads its model."""
    from ray import serve
    app = serve.status().applications.get(app_name)
    have = app.deployments if app else {}
    return {name: dict(have[name].replica_states) if name in have else {} for name in deployments}


def _deploy_apps(serve_config: dict) -> None:
    """The declarative path (Serve's own `serve deploy`): the only one that carries an application-level
    autoscaling policy, and the one KubeRay uses. Ray Serve has no public Python call for it (serve.run takes
    one Application and drops that policy), so this shim uses the private client Ray's CLI uses
    (ray.serve.context._get_global_client().deploy_apps; checked against Ray 2.60)."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(serve_config), _blocking=False)


def _wait_running(app_name: str, timeout_s: float = 600):
    from ray import serve
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        status = app.status if app else None
        if status == "RUNNING":
            return serve.get_app_handle(app_name)
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"Serve application {app_name} {status}: {app.message}")
        time.sleep(0.2)
    raise TimeoutError(f"Serve application {app_name} not running after {timeout_s:.0f} s")


def _cpus_needed(config: ClusterConfig) -> float:
    total = config.ingress.num_replicas * config.ingress.num_cpus
    for name in POOLS:
        pool = getattr(config, name)
        if pool is not None:
            n = pool.autoscaling.max_replicas if pool.autoscaling else pool.num_replicas
            total += n * pool.cpus_per_replica()
    return total


def stop() -> None:
    """Delete the app (its state actor ends with it: router/cluster_state.py) and shut Serve down."""
    from ray import serve

    from cluster.app import APP_NAME
    serve.delete(APP_NAME)
    serve.shutdown()
