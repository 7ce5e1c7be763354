"""ClusterConfig: one YAML schema; unknown keys and bad values are refused with their path and a
suggestion; the options it produces are accepted by Ray Serve's own classes."""
from __future__ import annotations

from pathlib import Path

import pytest
from ray.serve.config import AutoscalingConfig

from cluster.config import ClusterConfig
from engine import EngineConfig
from engine.errors import ConfigError

ROOT = Path(__file__).parents[1]


def test_the_example_file_loads_and_round_trips(tmp_path):
    cfg = ClusterConfig.from_yaml(ROOT / "deploy" / "cluster.yaml")
    again = tmp_path / "again.yaml"
    again.write_text(cfg.to_yaml())
    assert ClusterConfig.from_yaml(again) == cfg
    EngineConfig.from_kwargs(**cfg.engine_kwargs("prefill"))          # the engine accepts every knob


@pytest.mark.parametrize("doc, says", [
    ({"routr": {}}, "routr: unknown key (did you mean router?)"),
    ({"decode": {"num_replica": 2}}, "decode.num_replica: unknown key (did you mean num_replicas?)"),
    ({"decode": {"engine": {"max_num_seq": 8}}}, "unknown engine knob 'max_num_seq' (did you mean max_num_seqs?)"),
    ({"decode": {"engine": {"model": "x"}}}, "set once for the cluster"),
    ({"decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "min_replicas <= initial_replicas"),
    ({"mode": "colocated", "prefill": {}}, "colocated has no prefill pool"),
    ({"transfer": {"backend": "carrier-pigeon"}}, "transfer.backend"),
    ({"port": 0}, "port"),
])
def test_bad_configs_say_what_and_where(doc, says):
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_dict(doc)
    assert says in str(e.value)


def test_options_fit_ray_serve_and_overrides_apply():
    cfg = ClusterConfig.from_dict({"decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 4},
                                              "num_gpus": 1}})
    opts = cfg.deployment_options("decode")
    assert "num_replicas" not in opts and opts["ray_actor_options"]["num_gpus"] == 1
    AutoscalingConfig(**opts["autoscaling_config"])
    over = cfg.with_overrides(model="llama-tiny", prefill_replicas=2, decode_replicas=3)
    assert over.model == "llama-tiny" and over.deployment_options("prefill")["num_replicas"] == 2
    assert over.deployment_options("decode")["num_replicas"] == 3
    colo = ClusterConfig.from_dict({"mode": "colocated"})
    assert colo.prefill is None
    with pytest.raises(ConfigError, match="no prefill pool"):
        colo.with_overrides(prefill_replicas=1)


def test_the_serve_config_file_names_the_same_builder():
    import importlib

    import yaml
    from ray import serve
    from ray.serve.schema import ServeDeploySchema
    doc = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(doc)
    (app,) = schema.applications
    module, attr = app.import_path.split(":")
    builder = getattr(importlib.import_module(module), attr)
    built = builder({"config": str(ROOT / app.args["config"])})
    assert isinstance(built, serve.Application)
