"""ClusterConfig: one YAML schema; unknown keys and bad values are refused with their path and a
suggestion; the options it produces are accepted by Ray Serve's own classes, the knobs by EngineConfig."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from ray.serve._private.config import ReplicaConfig
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import DeploymentSchema

from cluster.autoscaling import Coupling, DecodeAutoscaling, PrefillAutoscaling
from cluster.config import POOL_KV_CACHE_BYTES_WITHOUT_GPU, Autoscaling, ClusterConfig, EngineKnobs, PrefillPoolConfig
from engine import EngineConfig
from kvtransfer.config import TransferConfig
from router.config import AdmissionConfig, AuthConfig, DisaggregationConfig, LimitsConfig, RouterConfig
from engine.errors import ConfigError

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "deploy" / "cluster.yaml"


def test_defaults_are_one_cpu_prefill_and_one_cpu_decode_replica_on_localhost():
    cfg = ClusterConfig()
    assert (cfg.mode, cfg.host, cfg.port, cfg.model_name()) == ("disaggregated", "127.0.0.1", 8000,
                                                                "SmolLM2-135M-Instruct")
    for pool in ("prefill", "decode"):
        assert cfg.deployment_options(pool) == {"num_replicas": 1, "max_ongoing_requests": 64,
                                                "ray_actor_options": {"num_cpus": 1.0, "num_gpus": 0.0},
                                                "graceful_shutdown_timeout_s": 120.0,
                                                "health_check_period_s": 2.0, "health_check_timeout_s": 10.0,
                                                "logging_config": {"enable_access_log": False}}
        engine = cfg.pool(pool).engine_config(cfg)
        assert isinstance(engine, EngineConfig)
        assert engine.kv_cache_memory == POOL_KV_CACHE_BYTES_WITHOUT_GPU == 512 << 20
        assert (engine.model, engine.device, engine.block_size) == (None, "auto", 16)
    ingress = cfg.deployment_options("ingress")
    assert ingress["max_ongoing_requests"] > 5       # Serve's default would throttle
    # an ingress replica leaving (node drain) finishes its streams, which may wait on a decode replica moving
    # with it: as long as a decode replica's own stop may take, not Serve's 20 s
    assert ingress["graceful_shutdown_timeout_s"] >= cfg.decode.graceful_shutdown_timeout_s


def test_the_example_file_has_every_section_loads_and_round_trips(tmp_path):
    assert set(yaml.safe_load(EXAMPLE.read_text())) == set(ClusterConfig.model_fields)
    cfg = ClusterConfig.from_yaml(EXAMPLE)
    assert cfg.decode.engine.max_num_seqs == 64 and cfg.router.policy == "prefix_aware"
    again = tmp_path / "again.yaml"
    again.write_text(cfg.to_yaml())
    assert ClusterConfig.from_yaml(again) == cfg
    for pool in ("prefill", "decode"):
        assert isinstance(cfg.engine_config(pool), EngineConfig)     # what a replica gets


def test_the_commented_out_alternatives_in_the_example_load_too():
    lines = [re.sub(r"^(\s*)# (\s*\w+:)", r"\1\2", line) for line in EXAMPLE.read_text().splitlines()
             if "instead of num_replicas" not in line]         # autoscaling replaces that line
    cfg = ClusterConfig.from_dict(yaml.safe_load("\n".join(lines)))
    assert cfg.prefill.num_replicas is None and cfg.prefill.autoscaling.max_replicas == 4
    assert cfg.prefill.autoscaling.ttft_slo_s == 2.0 and cfg.decode.autoscaling.target_kv_utilization == 0.8
    assert cfg.prefill.memory == 4 << 30
    assert cfg.decode.engine_config(cfg).speculative_config.method == "ngram"


def test_a_full_config_round_trips_through_yaml(tmp_path):
    cfg = ClusterConfig.from_dict({
        "model": "llama-tiny", "served_model_name": "tiny", "dtype": "bfloat16", "device": "cuda",
        "host": "0.0.0.0", "port": 9000, "ingress": {"num_replicas": 2, "num_cpus": 0.5},
        "prefill": {"autoscaling": {"min_replicas": 0, "max_replicas": 8, "initial_replicas": 2,
                                    "cooldown_s": 3.5, "ttft_slo_s": 0}, "num_gpus": 1, "memory": 8 << 30,
                    "engine": {"kv_cache_memory": 0.8, "enable_chunked_prefill": False}},
        "decode": {"num_replicas": 3, "num_gpus": 1,
                   "engine": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}},
        "router": {"policy": "pow2", "load_weight": 0.5}, "transfer": {"backend": "ray", "ucx_tls": "tcp"}})
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    back = ClusterConfig.from_yaml(path)
    assert back == cfg and back.to_yaml() == cfg.to_yaml()
    assert back.prefill.autoscaling.initial_replicas == 2 and back.prefill.engine.kv_cache_memory == 0.8
    dumped = yaml.safe_load(cfg.to_yaml())                   # knobs left unset stay out (no wall of nulls)
    assert dumped["prefill"]["engine"] == {"kv_cache_memory": 0.8, "enable_chunked_prefill": False}
    assert "num_replicas" not in dumped["prefill"] and "ucx_tls" in dumped["transfer"]
    colocated = ClusterConfig.from_dict({"mode": "colocated", "decode": {"num_replicas": 2}})
    path.write_text(colocated.to_yaml())
    assert ClusterConfig.from_yaml(path) == colocated


@pytest.mark.parametrize("doc, says", [
    ({"routr": {}}, "  routr: unknown key (did you mean router?)"),
    ({"decode": {"num_replica": 2}}, "  decode.num_replica: unknown key (did you mean num_replicas?)"),
    ({"decode": {"engine": {"max_num_seq": 8}}},
     "  decode.engine.max_num_seq: unknown key (did you mean max_num_seqs?)"),
    ({"prefill": {"autoscaling": {"max_replica": 2}}},
     "  prefill.autoscaling.max_replica: unknown key (did you mean max_replicas?)"),
    ({"transfer": {"ucx": "tcp"}}, "  transfer.ucx: unknown key (did you mean ucx_tls?)"),
    ({"qwerty": 1}, "  qwerty: unknown key\n"),
    ({"decode": {"engine": {"model": "x"}}}, "  decode.engine.model: set once for the cluster (top-level `model:`)"),
    ({"prefill": {"engine": {"dtype": "fp16"}}}, "  prefill.engine.dtype: set once for the cluster"),
    ({"decode": {"engine": {"distributed_executor_backend": "mp"}}},
     "  decode.engine.distributed_executor_backend: set by the cluster"),
])
def test_unknown_keys_are_named_with_their_path_and_a_suggestion(doc, says):
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_dict(doc)
    assert says in str(e.value) + "\n"
    if "did you mean" not in says:
        assert "did you mean" not in str(e.value)


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_dict({"routr": {}, "port": 0, "decode": {"engine": {"max_num_seq": 8, "model": "m"}}})
    lines = str(e.value).splitlines()
    assert lines[0] == "invalid cluster config:" and len(lines) == 5


@pytest.mark.parametrize("doc, says", [
    ({"decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
     "decode.autoscaling: min_replicas (3) is more than max_replicas (2)"),
    ({"decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 5}}},
     "decode.autoscaling: initial_replicas (5) must lie between min_replicas (1) and max_replicas (2)"),
    ({"decode": {"num_replicas": 2, "autoscaling": {"max_replicas": 2}}},
     "decode: set num_replicas or autoscaling, not both"),
    ({"decode": {"num_replicas": 0}}, "decode.num_replicas: Input should be greater than or equal to 1 (got 0)"),
    ({"mode": "colocated", "prefill": {}}, "prefill: mode colocated has no prefill pool"),
    ({"prefill": None}, "prefill: mode disaggregated needs a prefill pool"),
    ({"mode": "split"}, "mode: Input should be 'disaggregated' or 'colocated' (got 'split')"),
    ({"port": 70000}, "port: Input should be less than or equal to 65535"),
    ({"prefill": {"num_cpus": -1}}, "prefill.num_cpus: Input should be greater than or equal to 0"),
    ({"transfer": {"backend": "carrier-pigeon"}}, "transfer.backend: Input should be 'nixl' or 'ray'"),
    ({"transfer": {"ttl_s": 0}}, "transfer.ttl_s: Input should be greater than 0"),
    ({"router": {"index_sync_interval_s": 0}}, "router.index_sync_interval_s: Input should be greater than 0"),
    ({"dtype": "int8"}, "dtype: Input should be"),
    ({"decode": {"engine": {"block_size": 12}}}, "decode.engine: block_size must be a power of two, got 12"),
    ({"decode": {"engine": {"max_num_seqs": 0}}}, "decode.engine: max_num_seqs must be positive, got 0"),
    ({"decode": {"engine": {"kv_cache_memory": 1.5}}},
     "decode.engine: kv_cache_memory as a fraction must be in (0, 1]"),
    ({"decode": {"engine": {"kv_cache_memory": "lots"}}}, "decode.engine.kv_cache_memory: must be bytes"),
    ({"decode": {"engine": {"max_model_len": "long"}}}, "decode.engine.max_model_len: Input should be a valid integer"),
    ({"decode": {"engine": {"speculative_config": {"method": "magic"}}}},
     "decode.engine.speculative_config: method must be one of ngram, draft_model, layer_skip, eagle, eagle3, mtp, "
     "got 'magic'"),
    ({"prefill": {"engine": {"block_size": 32}}},
     "prefill.engine.block_size (32) and decode.engine.block_size (16) must match"),
    ({"decode": {"engine": {"kv_cache_dtype": "int8"}}},
     "prefill.engine.kv_cache_dtype (auto) and decode.engine.kv_cache_dtype (int8) must match"),
    ({"decode": {"engine": {"kv_cache_dtype": "int4"}}}, "decode.engine.kv_cache_dtype: Input should be 'auto'"),
    ({"decode": {"num_gpus": 4, "engine": {"tensor_parallel_size": 2}}},
     "decode.num_gpus: 4 but decode.engine.tensor_parallel_size is 2"),
    ({"prefill": {"num_gpus": 1, "engine": {"tensor_parallel_size": 4}}},
     "prefill.num_gpus: 1 but prefill.engine.tensor_parallel_size is 4"),
    ({"decode": {"num_gpus": 8}}, "decode.num_gpus: 8 but decode.engine.tensor_parallel_size is 1"),
    ({"decode": {"num_gpus": 1.5, "engine": {"tensor_parallel_size": 2}}},
     "decode.num_gpus: 1.5 but decode.engine.tensor_parallel_size is 2"),
    ({"decode": {"num_cpus": 0, "engine": {"tensor_parallel_size": 2}}},
     "decode.num_cpus: 0 but decode.engine.tensor_parallel_size is 2 without GPUs"),
    ({"decode": {"engine": {"tensor_parallel_size": 0}}},
     "decode.engine.tensor_parallel_size: Input should be greater than or equal to 1"),
    ({"chat": {"template": "templates/missing.jinja"}},
     "chat.template: 'templates/missing.jinja' is neither a file nor a Jinja template"),
])
def test_bad_values_say_what_and_where(doc, says):
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_dict(doc)
    assert says in str(e.value)


def test_a_chat_template_is_a_files_text_read_with_the_config_or_the_text_itself(tmp_path):
    """The deployed config carries the template's text, so an ingress on any node renders with it."""
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template)
    assert ClusterConfig.from_dict({"chat": {"template": str(tmp_path / "chat.jinja")}}).chat.template == template
    assert ClusterConfig.from_dict({"chat": {"template": template}}).chat.template == template
    cfg = ClusterConfig.from_dict({"chat": {"template": template, "trust_request_template": True}})
    (tmp_path / "again.yaml").write_text(cfg.to_yaml())
    assert ClusterConfig.from_yaml(tmp_path / "again.yaml") == cfg
    assert ClusterConfig().chat.template is None and not ClusterConfig().chat.trust_request_template


def test_unreadable_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read cluster config"):
        ClusterConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot read cluster config"):
        ClusterConfig.from_yaml(bad)
    bad.write_text("- decode\n")
    with pytest.raises(ConfigError, match="expected a mapping of keys, got list"):
        ClusterConfig.from_yaml(bad)
    bad.write_text("decode:\n  engine:\n    max_num_seq: 8\n")
    with pytest.raises(ConfigError, match=re.escape(f"{bad}:\n  decode.engine.max_num_seq: unknown key")):
        ClusterConfig.from_yaml(bad)
    bad.write_text("")
    assert ClusterConfig.from_yaml(bad) == ClusterConfig()       # an empty file is the defaults


def test_overrides_for_the_cli_flags():
    cfg = ClusterConfig.from_dict({"decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 4}},
                                   "prefill": {"engine": {"max_num_seqs": 8}}})
    over = cfg.with_overrides(model="llama-tiny", prefill_replicas=2, decode_replicas=3, port=9000,
                              chat_template="{{ messages[0].content }}", trust_request_chat_template=True)
    assert (over.model, over.port, over.model_name()) == ("llama-tiny", 9000, "llama-tiny")
    assert over.chat.template == "{{ messages[0].content }}" and over.chat.trust_request_template
    assert over.deployment_options("prefill")["num_replicas"] == 2
    assert over.prefill.engine.max_num_seqs == 8                        # the rest of the pool is kept
    assert over.decode.autoscaling is None and over.deployment_options("decode")["num_replicas"] == 3
    assert cfg.decode.autoscaling is not None and cfg.model is None     # the original is unchanged
    assert cfg.with_overrides() == cfg
    with pytest.raises(ConfigError, match="decode.num_replicas"):
        cfg.with_overrides(decode_replicas=0)
    colocated = ClusterConfig.from_dict({"mode": "colocated"})
    with pytest.raises(ConfigError, match="--prefill-replicas: mode colocated has no prefill pool"):
        colocated.with_overrides(prefill_replicas=1)


def test_colocated_mode_has_only_the_decode_pool():
    cfg = ClusterConfig.from_dict({"mode": "colocated", "prefill": None, "decode": {"num_replicas": 2}})
    assert cfg.prefill is None and cfg.deployment_options("decode")["num_replicas"] == 2
    with pytest.raises(ConfigError, match="no prefill pool"):
        cfg.deployment_options("prefill")
    with pytest.raises(ConfigError, match="no prefill pool"):
        cfg.engine_config("prefill")


def test_deployment_options_are_accepted_by_ray_serve():
    cfg = ClusterConfig.from_dict({
        "prefill": {"num_replicas": 2, "num_gpus": 1, "memory": 4 << 30},
        "decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 5}, "num_cpus": 2},
        "transfer": {"ucx_tls": "shm,tcp"}, "ingress": {"resources": {"cpu_node": 1}}})
    for name in ("ingress", "prefill", "decode"):
        opts = cfg.deployment_options(name)
        schema = DeploymentSchema(name=name, **opts)                     # Serve's own option schema
        assert schema.max_ongoing_requests == opts["max_ongoing_requests"]
        assert schema.graceful_shutdown_timeout_s == opts["graceful_shutdown_timeout_s"] == 120
    assert cfg.deployment_options("ingress")["ray_actor_options"] == {"num_cpus": 0.0, "resources": {"cpu_node": 1}}
    decode = cfg.deployment_options("decode", "baton-state-x")
    assert "num_replicas" not in decode
    scaling = AutoscalingConfig(**decode["autoscaling_config"])      # Serve imports and pickles the policy
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 4)
    assert scaling.upscale_delay_s == scaling.downscale_delay_s == 0     # the delays are Baton's policy's
    assert scaling.policy.policy_function == "cluster.autoscaling:PoolPolicy"
    kw = scaling.policy.policy_kwargs
    assert (kw["pool"], kw["upscale_delay_s"], kw["state_actor"]) == ("decode", 5, "baton-state-x")
    assert kw["target_running_seqs"] == 48                          # 3/4 of the engine's max_num_seqs (64)
    prefill = cfg.deployment_options("prefill")["ray_actor_options"]
    assert prefill == {"num_cpus": 1.0, "num_gpus": 1.0, "memory": 4 << 30,
                       "runtime_env": {"env_vars": {"UCX_TLS": "shm,tcp"}}}
    as_ray = ClusterConfig.from_dict({"transfer": {"backend": "ray", "ucx_tls": "shm,tcp"}})
    assert "runtime_env" not in as_ray.deployment_options("decode")["ray_actor_options"]


def test_a_tp_replica_asks_serve_for_one_packed_bundle_per_rank():
    cfg = ClusterConfig.from_dict({
        "prefill": {"num_gpus": 4, "num_cpus": 8, "memory": 64 << 30, "resources": {"baton_prefill": 1},
                    "engine": {"tensor_parallel_size": 4}},
        "decode": {"num_cpus": 1, "engine": {"tensor_parallel_size": 2}}})     # no GPUs: ranks on CPUs
    prefill = cfg.deployment_options("prefill")
    assert prefill["placement_group_strategy"] == "STRICT_PACK"             # NCCL ranks on one node
    assert prefill["placement_group_bundles"] == [
        {"CPU": 8.0, "GPU": 1.0, "memory": 64 << 30, "baton_prefill": 1.0}] + [{"CPU": 1.0, "GPU": 1.0}] * 3
    assert prefill["ray_actor_options"] == {"num_cpus": 8.0, "num_gpus": 1.0, "memory": 64 << 30,
                                            "resources": {"baton_prefill": 1.0}}    # rank 0, in bundle 0
    assert cfg.engine_config("prefill").tensor_parallel_size == 4
    decode = cfg.deployment_options("decode")
    assert decode["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert decode["ray_actor_options"]["num_gpus"] == 0
    for name in ("prefill", "decode"):          # Serve's own checks, the replica actor fitting bundle 0 among them
        opts = cfg.deployment_options(name)
        DeploymentSchema(name=name, **opts)
        ReplicaConfig.create(object, ray_actor_options=opts["ray_actor_options"],
                             placement_group_bundles=opts["placement_group_bundles"],
                             placement_group_strategy=opts["placement_group_strategy"])
    one = ClusterConfig.from_dict({"decode": {"num_gpus": 1}, "prefill": {"num_gpus": 0.5}})
    for name in ("prefill", "decode"):                                      # TP 1: no placement group, as before
        assert "placement_group_bundles" not in one.deployment_options(name)
    assert one.deployment_options("prefill")["ray_actor_options"]["num_gpus"] == 0.5   # a shared GPU


def test_autoscaling_knobs_shared_with_ray_serve_have_its_names_and_defaults():
    ray_defaults = AutoscalingConfig()
    shared = set(Autoscaling.model_fields) & set(AutoscalingConfig.model_fields)
    assert shared >= {"min_replicas", "max_replicas", "initial_replicas", "upscale_delay_s", "downscale_delay_s",
                      "look_back_period_s", "metrics_interval_s"}
    for name in shared:
        assert getattr(ray_defaults, name) == Autoscaling.model_fields[name].default, name


def test_engine_config_merges_cluster_fields_with_pool_knobs():
    cfg = ClusterConfig.from_dict({"model": "llama-tiny", "dtype": "float32", "device": "cpu",
                                   "prefill": {"engine": {"max_num_batched_tokens": 512, "num_kv_blocks": 100}},
                                   "decode": {"num_gpus": 1, "engine": {"max_num_seqs": 8, "max_model_len": 1024}}})
    prefill = cfg.prefill.engine_config(cfg)
    assert (prefill.model, prefill.dtype, prefill.device) == ("llama-tiny", "float32", "cpu")
    assert (prefill.max_num_batched_tokens, prefill.num_kv_blocks, prefill.kv_cache_memory) == (512, 100, None)
    decode = cfg.decode.engine_config(cfg)
    assert (decode.max_num_seqs, decode.max_model_len) == (8, 1024)
    assert decode.kv_cache_memory is None            # a GPU of its own: the engine's fraction of free memory
    assert decode.max_num_batched_tokens == EngineConfig().max_num_batched_tokens   # unset: engine default
    own = ClusterConfig.from_dict({"decode": {"engine": {"kv_cache_memory": 64 << 20}}})
    assert own.decode.engine_config(own).kv_cache_memory == 64 << 20


def test_engine_knobs_are_exactly_the_engine_config_fields_but_the_cluster_level_ones():
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(EngineKnobs.model_fields) == engine_fields - {"model", "dtype", "device", "distributed_executor_backend",
                                                              "max_grammar_bytes", "grammar_compile_timeout_s",
                                                              "enable_lora"}
    limited = ClusterConfig.from_dict({"limits": {"max_grammar_bytes": 999, "grammar_compile_timeout_s": 2.5}})
    for pool in ("prefill", "decode"):                   # the limits section sets them for both pools' engines
        e = limited.engine_config(pool)
        assert (e.max_grammar_bytes, e.grammar_compile_timeout_s) == (999, 2.5)
    assert {"model", "dtype", "device"} <= set(ClusterConfig.model_fields)
    cfg = ClusterConfig.from_dict({"decode": {"engine": {"tensor_parallel_size": 2}}})   # the cluster picks it
    assert (cfg.engine_config("decode").distributed_executor_backend, cfg.engine_config("prefill")
            .distributed_executor_backend) == ("ray", "mp")


def test_every_field_is_documented():
    def models(m: type[BaseModel]):
        yield m
        for field in m.model_fields.values():
            for a in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(a, type) and issubclass(a, BaseModel):
                    yield from models(a)
    seen = set(models(ClusterConfig))
    assert {PrefillAutoscaling, DecodeAutoscaling, Coupling, EngineKnobs, PrefillPoolConfig, TransferConfig, RouterConfig,
            DisaggregationConfig, LimitsConfig, AdmissionConfig, AuthConfig} <= seen     # the sections other packages own
    for m in seen:
        for name, field in m.model_fields.items():
            assert field.description and len(field.description) > 8, f"{m.__name__}.{name}"


def test_the_serve_config_file_names_the_same_builder():
    import importlib

    from ray import serve
    from ray.serve.schema import ServeDeploySchema
    doc = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    (app,) = ServeDeploySchema.model_validate(doc).applications
    module, attr = app.import_path.split(":")
    builder = getattr(importlib.import_module(module), attr)
    assert isinstance(builder({"config": str(ROOT / app.args["config"])}), serve.Application)


def test_the_configuration_reference_is_generated_from_the_schema():
    from cluster.reference import DOC_PATH, render
    text = DOC_PATH.read_text()
    assert text == render(), "stale: run python -m cluster.reference"
    for key in ("target_kv_utilization", "cooldown_s", "ratio_window_s", "graceful_shutdown_timeout_s"):
        assert f"| `{key}` |" in text


def test_resizing_a_fixed_pool_keeps_the_apps_code_version_so_serve_updates_in_place():
    """Serve rolls every replica when an app's code version (import path + args) changes and applies a changed
    deployment override in place. A pool's size is an override: a resize keeps the version; an engine change
    does not. serve_config and cluster_config_of round-trip."""
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeDeploySchema

    from cluster.app import cluster_config_of, serve_config

    def app(cfg: ClusterConfig):
        (a,) = ServeDeploySchema.model_validate(serve_config(cfg)).applications
        return a
    base = ClusterConfig.from_dict({"prefill": {"num_replicas": 2}, "decode": {"num_replicas": 2}})
    smaller = base.with_overrides(decode_replicas=1, prefill_replicas=3)
    engine = ClusterConfig.from_dict({"prefill": {"num_replicas": 2},
                                      "decode": {"num_replicas": 2, "engine": {"max_num_seqs": 7}}})
    assert get_app_code_version(app(smaller)) == get_app_code_version(app(base))
    assert get_app_code_version(app(engine)) != get_app_code_version(app(base))
    assert {d.name: d.num_replicas for d in app(smaller).deployments} == {"prefill": 3, "decode": 1}
    for cfg in (base, smaller, engine):
        assert cluster_config_of(serve_config(cfg)["applications"][0]) == cfg
    colocated = ClusterConfig.from_dict({"mode": "colocated", "decode": {"num_replicas": 3}})
    assert cluster_config_of(serve_config(colocated)["applications"][0]) == colocated
    scaled = ClusterConfig.from_dict({"decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 4}}})
    assert [d["name"] for d in serve_config(scaled)["applications"][0]["deployments"]] == ["prefill"]


def test_a_local_ray_start_that_times_out_is_tried_once_more_and_other_errors_are_not(monkeypatch):
    """init_ray: Ray's own start-up timing out (a raylet not registering, a GCS not publishing its port, in either
    case) starts a local Ray once more; any other error, or a timeout joining a cluster at an address, is raised."""
    import ray

    from cluster.serving import init_ray
    calls, shutdowns = [], []

    def fake_init(errors):
        def init(**kwargs):
            calls.append(kwargs)
            if errors:
                raise errors.pop(0)
            return "started"
        return init
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    monkeypatch.setattr(ray, "init", fake_init([Exception("Timed out waiting for file /tmp/ray/s/gcs_server_port_x")]))
    assert init_ray(num_cpus=2) == "started" and len(calls) == 2 and len(shutdowns) == 1
    monkeypatch.setattr(ray, "init", fake_init([Exception("The current node timed out during startup")]))
    assert init_ray(address="local") == "started"
    for err, kwargs in ((ValueError("bad resources"), {}), (Exception("timed out"), {"address": "10.0.0.1:6379"})):
        calls.clear()
        monkeypatch.setattr(ray, "init", fake_init([err]))
        with pytest.raises(type(err)):
            init_ray(**kwargs)
        assert len(calls) == 1


def test_a_local_ray_start_runs_serve_in_its_throughput_mode_unless_the_environment_says_otherwise(monkeypatch):
    """init_ray sets SERVE_ENV in the environment a local Ray's processes inherit, under any value already set
    there; joining a cluster at an address leaves it alone (that cluster's `ray start` had its own)."""
    import os

    import ray

    from cluster.serving import SERVE_ENV, init_ray
    for k in SERVE_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0")
    seen = []
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append({k: os.environ.get(k) for k in SERVE_ENV}))
    init_ray(address="10.0.0.1:6379")
    assert seen[-1] == {k: "0" if k == "RAY_SERVE_THROUGHPUT_OPTIMIZED" else None for k in SERVE_ENV}
    init_ray(num_cpus=2)
    assert seen[-1] == {**SERVE_ENV, "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}
    assert SERVE_ENV["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"


def test_the_image_runs_serve_as_baton_serve_does():
    """deploy/Dockerfile.cuda's ENV holds SERVE_ENV (for `ray start` and `serve run` in the image)."""
    from cluster.serving import SERVE_ENV
    text = (Path(__file__).parents[1] / "deploy" / "Dockerfile.cuda").read_text()
    assert dict(re.findall(r"^\s*(?:ENV\s+)?(RAY_SERVE_\w+)=(\S+?)\s*\\?$", text, re.M)) == SERVE_ENV
