"""build_app(config): the one place the Serve application is built, from one ClusterConfig.

    Ingress (router/ingress.py, FastAPI)  --handle-->  PrefillServer pool   (PrefixAwareRouter)
                                          --handle-->  DecodeServer pool    (DecodeRouter)
    ClusterState actor (router/cluster_state.py): KV events and metrics of every replica

Colocated mode builds no prefill pool: the decode pool prefills every prompt itself.
`serve run cluster.app:app_builder config=deploy/cluster.yaml` and `baton serve` both come here.
"""
from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.config import ClusterConfig
from decode_worker.server import DecodeServer
from prefill_worker.server import PrefillServer
from router.cluster_state import state_actor_name
from router.ingress import Ingress

STATS_PERIOD_S = 0.2            # Serve polls each replica's record_routing_stats this often


def _router_config(cls: str, kwargs: dict[str, Any]) -> RequestRouterConfig:
    return RequestRouterConfig(request_router_class=cls, request_router_kwargs=kwargs,
                               request_routing_stats_period_s=STATS_PERIOD_S,
                               request_routing_stats_timeout_s=5.0)


def build_app(config: ClusterConfig, app_name: str = "baton") -> serve.Application:
    state = state_actor_name(app_name)
    transfer = {"backend": config.transfer.backend, "ttl_s": config.transfer.ttl_s}
    common = {"transfer": transfer, "state_actor": state, "served_model_name": config.model_name()}
    r = config.router
    decode_engine = config.engine_kwargs("decode")
    decode = serve.deployment(DecodeServer, name="decode").options(
        **config.deployment_options("decode"),
        request_router_config=_router_config("router.request_routers.DecodeRouter", {
            "state_actor": state, "block_size": decode_engine.get("block_size", 16),
            "max_num_seqs": decode_engine.get("max_num_seqs", 64),
            "index_sync_interval_s": r.index_sync_interval_s}),
    ).bind(engine=decode_engine, **common)
    prefill = None
    if config.mode == "disaggregated":
        prefill_engine = config.engine_kwargs("prefill")
        opts = config.deployment_options("prefill")
        if r.policy == "prefix_aware":
            opts["request_router_config"] = _router_config("router.request_routers.PrefixAwareRouter", {
                "state_actor": state, "block_size": prefill_engine.get("block_size", 16),
                "load_weight": r.load_weight, "imbalance_threshold_tokens": r.imbalance_threshold_tokens,
                "index_sync_interval_s": r.index_sync_interval_s})
        else:       # Serve's default power-of-two choices, the baseline prefix-aware routing is measured against
            opts["request_router_config"] = RequestRouterConfig(request_routing_stats_period_s=STATS_PERIOD_S)
        prefill = serve.deployment(PrefillServer, name="prefill").options(**opts).bind(engine=prefill_engine, **common)
    ingress = serve.deployment(Ingress, name="ingress").options(**config.deployment_options("ingress"))
    return ingress.bind(prefill=prefill, decode=decode, config=config.model_dump(mode="json"), state_actor=state)


def app_builder(args: dict[str, str]) -> serve.Application:
    """For `serve run cluster.app:app_builder config=FILE` (deploy/serve.yaml uses it too)."""
    path = args.get("config")
    config = ClusterConfig.from_yaml(path) if path else ClusterConfig()
    return build_app(config)
