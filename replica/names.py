"""Names every process of one Baton app agrees on: its deployments (the two pools, the ingress, the state
keeper) and where the cluster state actor lives (router/cluster_state.py), which every replica reports to
and every router reads. Plain constants: the autoscaling policy, shipped by value into Serve's controller,
takes them along."""
from __future__ import annotations

PREFILL, DECODE, INGRESS, STATE = "prefill", "decode", "ingress", "state"
POOLS = (PREFILL, DECODE)
STATE_NAMESPACE = "baton"       # Serve replicas run in the "serve" namespace, drivers in theirs: name it


def state_actor_name(app_name: str) -> str:
    return f"baton-state-{app_name}"


def get_state_actor(name: str):
    """The app's cluster state actor; ValueError while it does not exist (yet)."""
    import ray
    return ray.get_actor(name, namespace=STATE_NAMESPACE)
