"""build_app(config): the one place the Serve application is built, from one ClusterConfig.

    Ingress (router/ingress.py, FastAPI)  --handle-->  PrefillServer pool   (PrefixAwareRouter)
                                          --handle-->  DecodeServer pool    (DecodeRouter)
    ClusterStateOwner (one replica)  --owns-->  ClusterState actor (router/cluster_state.py): KV events and
                                                metrics of every replica; deleting the app ends it

Colocated mode builds no prefill pool: the decode pool prefills every prompt itself.

serve_config(config) is the Serve config (`serve deploy` / `serve run` schema) that deploys it: the
application `cluster.app:app_builder` with the cluster config inline as its `config` argument and the coupled
autoscaling policy at application level. `baton serve`, deploy/serve.yaml and the Helm chart's serveConfigV2
all take this one path, so the coupled policy runs wherever Baton does.
"""
from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.config import ClusterConfig
from decode_worker.server import DecodeServer
from prefill_worker.server import PrefillServer
from replica.names import DECODE, INGRESS, PREFILL, STATE, state_actor_name
from router.cluster_state import ClusterStateOwner
from router.ingress import Ingress

APP_NAME = "baton"              # the Serve application's name, unless a caller names it
STATS_PERIOD_S = 0.2            # Serve polls each replica's record_routing_stats this often


def _router_config(cls: str, kwargs: dict[str, Any]) -> RequestRouterConfig:
    return RequestRouterConfig(request_router_class=cls, request_router_kwargs=kwargs,
                               request_routing_stats_period_s=STATS_PERIOD_S,
                               request_routing_stats_timeout_s=5.0)


def build_app(config: ClusterConfig, app_name: str = APP_NAME) -> serve.Application:
    state = state_actor_name(app_name)
    # no access log: every /metrics scrape calls it, and Serve 2.60 keeps each access-log record alive
    owner = serve.deployment(ClusterStateOwner, name=STATE).options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False}).bind(state)
    common = {"transfer": config.transfer, "state_actor": state, "served_model_name": config.model_name()}
    r = config.router
    decode_engine = config.engine_config(DECODE)
    decode = serve.deployment(DecodeServer, name=DECODE).options(
        **config.deployment_options(DECODE, state),
        request_router_config=_router_config("router.request_routers.DecodeRouter", {
            "state_actor": state, "block_size": decode_engine.block_size, "max_num_seqs": decode_engine.max_num_seqs,
            "index_sync_interval_s": r.index_sync_interval_s, "host_tier_hit_weight": r.host_tier_hit_weight,
            "lora_load_cost_tokens": r.lora_load_cost_tokens, "load_weight": r.load_weight,
            "imbalance_threshold_tokens": r.imbalance_threshold_tokens}),
    ).bind(engine=decode_engine, stream_interval_s=config.decode.stream_interval_ms / 1e3, **common)
    prefill = None
    if config.mode == "disaggregated":
        prefill_engine = config.engine_config(PREFILL)
        opts = config.deployment_options(PREFILL, state)
        if r.policy == "prefix_aware":      # request_router_kwargs must be JSON: the section goes as its dump
            opts["request_router_config"] = _router_config("router.request_routers.PrefixAwareRouter", {
                "state_actor": state, "block_size": prefill_engine.block_size, "router": r.model_dump(mode="json")})
        else:       # Serve's default power-of-two choices, the baseline prefix-aware routing is measured against
            opts["request_router_config"] = RequestRouterConfig(request_routing_stats_period_s=STATS_PERIOD_S)
        prefill = serve.deployment(PrefillServer, name=PREFILL).options(**opts).bind(engine=prefill_engine, **common)
    ingress = serve.deployment(Ingress, name=INGRESS).options(**config.deployment_options(INGRESS))
    return ingress.bind(prefill=prefill, decode=decode, state=owner, state_actor=state,
                        num_replicas=config.ingress.num_replicas, limits=config.limits, auth=config.auth,
                        admission=config.admission, disaggregation=config.disaggregation, router=r,
                        migration=config.migration, tools=config.tools, chat=config.chat,
                        reasoning=config.reasoning, lora=config.lora, stream_channels=config.decode.stream_channels)


COUPLED_POLICY = "cluster.autoscaling:CoupledPolicy"


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Serve's entry point: args `config` is a cluster config file's path or the config itself (a mapping);
    `app_name` names the state actor (default APP_NAME). `serve run cluster.app:app_builder config=FILE`."""
    config = args.get("config")
    if isinstance(config, dict):
        cfg = ClusterConfig.from_dict(config, source="cluster config in the Serve config's args")
    else:
        cfg = ClusterConfig.from_yaml(config) if config else ClusterConfig()
    return build_app(cfg, args.get("app_name", APP_NAME))


def serve_config(config: ClusterConfig, app_name: str = APP_NAME, proxy_location: str = "HeadOnly") -> dict[str, Any]:
    """The Serve config that deploys `config` (ServeDeploySchema): http options, one application built by
    app_builder from the inline cluster config, the coupled autoscaling policy when a pool autoscales.
    The Helm chart's serveConfigV2 is this with proxy_location EveryNode (a proxy on every pod).

    A fixed pool's size rides outside the app's args, as a Serve deployment override: Serve rebuilds the app
    and rolls every replica when the args change (they are the app's code version), but applies a changed
    override in place. So resizing a pool (`serve deploy`, a RayService edit) starts or stops only the replicas
    the new size needs; the others keep their streams, caches and counters. `cluster_config_of` reads it back."""
    args = config.model_dump(mode="json", exclude_none=True)
    deployments = []
    for pool in (PREFILL, DECODE):
        p = args.get(pool)
        if p is not None and "autoscaling" not in p:        # an autoscaled pool's size is its policy's to set
            deployments.append({"name": pool, "num_replicas": p.pop("num_replicas", 1)})
    app: dict[str, Any] = {"name": app_name, "route_prefix": "/", "import_path": "cluster.app:app_builder",
                           "args": {"config": args, "app_name": app_name}}
    if any(p is not None and p.autoscaling is not None for p in (config.prefill, config.decode)):
        app["autoscaling_policy"] = {"policy_function": COUPLED_POLICY}
    if deployments:
        app["deployments"] = deployments
    return {"proxy_location": proxy_location, "http_options": {"host": config.host, "port": config.port},
            "applications": [app]}


def cluster_config_of(app: dict[str, Any]) -> ClusterConfig:
    """The cluster config one application of a Serve config deploys: its args' config with the pool sizes
    of its deployment overrides (the inverse of serve_config)."""
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in app["args"]["config"].items()}
    for dep in app.get("deployments") or []:
        if dep.get("name") in (PREFILL, DECODE) and "num_replicas" in dep:
            d[dep["name"]] = {**d.get(dep["name"], {}), "num_replicas": dep["num_replicas"]}
    return ClusterConfig.from_dict(d, source=f"Serve application {app.get('name')}")
