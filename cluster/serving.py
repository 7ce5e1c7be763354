"""Starting and stopping the app on a local or existing Ray cluster (`baton serve`, tests, benchmarks)."""
from __future__ import annotations

import logging
import os

from cluster.config import ClusterConfig

log = logging.getLogger(__name__)
APP_NAME = "baton"


def start(config: ClusterConfig, app_name: str = APP_NAME, blocking: bool = False, num_cpus: int | None = None):
    """Deploy serve_config(config), as `serve deploy` would, and return the ingress handle. Starts a local Ray
    unless one is reachable. blocking: then wait until interrupted."""
    import time

    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from cluster.app import serve_config
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if num_cpus is None and address is None:   # a local Ray: room for every replica's logical CPUs
            num_cpus = max(os.cpu_count() or 1, int(-(-_cpus_needed(config) // 1)))
        ray.init(address=address, num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING",
                 namespace="baton")
    serve.start(http_options={"host": config.host, "port": config.port})
    # The declarative path (Serve's own `serve deploy`): the only one that carries an application-level
    # autoscaling policy, and the one KubeRay uses.
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(serve_config(config, app_name)),
                                     _blocking=False)
    handle = _wait_running(app_name)
    while blocking:
        time.sleep(1)
    return handle


def _wait_running(app_name: str, timeout_s: float = 600):
    import time

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
    for name in ("prefill", "decode"):
        pool = getattr(config, name)
        if pool is not None:
            n = pool.autoscaling.max_replicas if pool.autoscaling else pool.num_replicas
            total += n * pool.num_cpus
    return total


def stop(app_name: str = APP_NAME) -> None:
    """Delete the app and its state actor (a detached actor outlives the app otherwise)."""
    import ray
    from ray import serve

    from router.cluster_state import STATE_NAMESPACE, state_actor_name
    serve.delete(app_name)
    try:
        ray.kill(ray.get_actor(state_actor_name(app_name), namespace=STATE_NAMESPACE))
    except ValueError:
        pass
    serve.shutdown()
