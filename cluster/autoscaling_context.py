"""The AutoscalingContext Serve's controller hands a policy, built outside the controller: the autoscale
benchmark's fluid model and the policy tests drive Baton's real policies (cluster/autoscaling.py) with it."""
from __future__ import annotations

from ray.serve.config import AutoscalingConfig, AutoscalingContext


def context(pool: str, n: int, metrics: dict[str, dict], config: AutoscalingConfig, state: dict,
            now: float, replicas: list | None = None) -> AutoscalingContext:
    """The AutoscalingContext Serve's controller builds for a pool of n replicas reporting `metrics` (keyed by
    the running replicas' ids: `replicas`, "<pool>-<i>" for i < n unless given)."""
    replicas = [f"{pool}-{i}" for i in range(n)] if replicas is None else list(replicas)
    return AutoscalingContext(
        deployment_id=pool, deployment_name=pool, app_name="baton", current_num_replicas=n, target_num_replicas=n,
        running_replicas=replicas, total_num_requests=0.0, total_queued_requests=0.0, aggregated_metrics=metrics,
        raw_metrics={}, capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas, policy_state=state, last_scale_up_time=None,
        last_scale_down_time=None, current_time=now, config=config)
