"""Starting and stopping the app on a local or existing Ray cluster (`baton serve`, tests, benchmarks)."""
from __future__ import annotations

import logging
import os

from cluster.config import ClusterConfig

log = logging.getLogger(__name__)
APP_NAME = "baton"


def start(config: ClusterConfig, app_name: str = APP_NAME, blocking: bool = False, num_cpus: int | None = None):
    """Deploy build_app(config) and return its ingress handle. Starts a local Ray unless one is reachable."""
    import ray
    from ray import serve

    from cluster.app import build_app
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if num_cpus is None and address is None:   # a local Ray: room for every replica's logical CPUs
            num_cpus = max(os.cpu_count() or 1, int(-(-_cpus_needed(config) // 1)))
        ray.init(address=address, num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING",
                 namespace="baton")
    serve.start(http_options={"host": config.host, "port": config.port})
    return serve.run(build_app(config, app_name), name=app_name, route_prefix="/", blocking=blocking)


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
