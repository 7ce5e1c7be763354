"""The Helm chart (helm/baton), linted and rendered by Helm's own Go engine (helm-python-sdk): the RayService
validates against KubeRay's CRD schema (tests/data/kuberay, a named release), the embedded serveConfigV2 is
Serve's schema and Baton's cluster config (the same one serve_config builds), worker groups follow the
pools, and bad values fail at install time with the path of the mistake."""
from __future__ import annotations

import json
import re
from pathlib import Path

import helm_python as helm
import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.app import cluster_config_of, serve_config
from cluster.config import ClusterConfig
from cluster.helm_schema import SCHEMA_PATH, render
from cluster.serving import SERVE_ENV

ROOT = Path(__file__).parents[1]
CHART = ROOT / "helm" / "baton"
CRD = ROOT / "tests" / "data" / "kuberay" / "ray.io_rayservices.yaml"

CPU_ONLY = {"model": {"source": "builtin"},
            "ray": {"enableInTreeAutoscaling": False,
                    "workers": {p: {"resources": {"cpu": "2", "memory": "4Gi"}, "tolerations": []}
                                for p in ("prefill", "decode")}},
            "cluster": {"device": "cpu", "dtype": "float32",
                        "prefill": {"num_gpus": 0, "num_cpus": 1, "autoscaling": None, "num_replicas": 1},
                        "decode": {"num_gpus": 0, "num_cpus": 1, "autoscaling": None, "num_replicas": 2},
                        "transfer": {"ucx_tls": "shm,tcp"}}}
LARGE_GPU = {"model": {"source": "volume", "volume": {"claimName": "llama-70b", "path": "Llama-3.3-70B-Instruct"},
                       "tokenSecret": {"name": "hf", "key": "token"}},
             "ray": {"workers": {"prefill": {"resources": {"cpu": "32", "memory": "512Gi"},
                                             "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
                                 "decode": {"resources": {"cpu": "32", "memory": "512Gi"}}}},
             "cluster": {"prefill": {"num_gpus": 4, "engine": {"tensor_parallel_size": 4},
                                     "autoscaling": {"min_replicas": 2, "max_replicas": 16,
                                                     "initial_replicas": 4, "ttft_slo_s": 1.0}},
                         "decode": {"num_gpus": 8, "autoscaling": {"min_replicas": 2, "max_replicas": 32,
                                                                   "target_kv_utilization": 0.7},
                                    "engine": {"max_num_seqs": 256, "tensor_parallel_size": 8}},
                         "ingress": {"graceful_shutdown_timeout_s": 300},     # long streams: longer than the pools
                         "coupling": {"mode": "fixed", "ratio": 0.5}},
             "apiKeys": {"secretName": "baton-keys"},
             "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
             "grafanaDashboard": {"enabled": True}}
AUTOSCALING_OFF = {"ray": {"enableInTreeAutoscaling": False},
                   "cluster": {"prefill": {"autoscaling": None, "num_replicas": 2},
                               "decode": {"autoscaling": None, "num_replicas": 3}}}
COLOCATED = {"cluster": {"mode": "colocated", "prefill": None}}
VALUE_SETS = {"default": {}, "cpu-only": CPU_ONLY, "large-gpu": LARGE_GPU, "autoscaling-off": AUTOSCALING_OFF,
              "colocated": COLOCATED}


@pytest.fixture(scope="module")
def chart():
    c = helm.Chart.load(str(CHART))
    yield c
    c.close()


@pytest.fixture(scope="module")
def crd_schema():
    """A validator of KubeRay's schema for the resource, the schema itself checked once (2 s here, for each
    resource when jsonschema.validate did it per call); libyaml parses the 950 kB CRD in 0.5 s where Python took 3."""
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == "RayService"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = v1["schema"]["openAPIV3Schema"]
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def rendered(chart, values: dict) -> dict[str, list[dict]]:
    out = chart.render(values, name="baton", namespace="llm", is_install=True)
    docs: dict[str, list[dict]] = {}
    for path, text in out.items():
        if not path.endswith(".yaml"):
            continue                                     # NOTES.txt
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.setdefault(doc["kind"], []).append(doc)
    return docs


def test_the_chart_lints_clean_with_every_value_set():
    for name, values in VALUE_SETS.items():
        result = helm.lint(str(CHART), values, strict=True)
        assert result["errors"] == [], name
        assert not [m for m in result["messages"] if m["severity"] > 1], (name, result["messages"])


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_each_value_set_renders_a_rayservice_valid_under_kuberays_crd(chart, crd_schema, name):
    docs = rendered(chart, VALUE_SETS[name])
    (svc,) = docs["RayService"]
    crd_schema.validate(svc)                             # KubeRay's own OpenAPI schema for the resource

    serve = yaml.safe_load(svc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)              # Serve's own schema
    (app,) = serve["applications"]
    cfg = cluster_config_of(app)                         # Baton's own schema
    want = serve_config(cfg, proxy_location="EveryNode")
    want["applications"][0]["args"]["config"] = app["args"]["config"]
    assert serve == want                                 # the chart builds what Python builds

    merged = chart.merge_values(VALUE_SETS[name])
    groups = {g["groupName"]: g for g in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(groups) == ({"decode"} if cfg.mode == "colocated" else {"prefill", "decode"})
    for pool, g in groups.items():
        p = cfg.pool(pool)
        bounds = ((p.autoscaling.min_replicas, p.autoscaling.max_replicas) if p.autoscaling
                  else (p.num_replicas, p.num_replicas))
        assert (g["minReplicas"], g["maxReplicas"]) == bounds
        assert p.resources == {f"baton_{pool}": 1}       # each replica lands on its own group's pods
        assert g["rayStartParams"]["resources"] == f'"{{\\"baton_{pool}\\": 1}}"'
        (container,) = g["template"]["spec"]["containers"]
        gpus = container["resources"]["limits"].get("nvidia.com/gpu", 0)
        assert gpus == p.num_gpus and gpus in (0, p.tensor_parallel_size)   # a pod holds one replica's ranks
        assert container["resources"]["limits"]["cpu"] == merged["ray"]["workers"][pool]["resources"]["cpu"]
        # Kubernetes waits longer than Serve's graceful stop of any replica the pod may hold (a decode replica
        # hands its streams over first; an ingress replica, placed anywhere, finishes its streams)
        assert g["template"]["spec"]["terminationGracePeriodSeconds"] >= \
            max(p.graceful_shutdown_timeout_s, cfg.ingress.graceful_shutdown_timeout_s) + 30
    assert svc["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] == merged["ray"]["enableInTreeAutoscaling"]
    assert docs["Service"][0]["spec"]["ports"][0]["targetPort"] == 8000 == cfg.port
    assert cfg.host == "0.0.0.0"


def test_value_sets_differ_where_they_should(chart):
    default = rendered(chart, {})["RayService"][0]
    serve = yaml.safe_load(default["spec"]["serveConfigV2"])["applications"][0]
    assert serve["autoscaling_policy"] == {"policy_function": "cluster.autoscaling:CoupledPolicy"}
    head = default["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert head["initContainers"][0]["command"][-2:] == ["HuggingFaceTB/SmolLM2-135M-Instruct",
                                                         "/models/SmolLM2-135M-Instruct"]
    assert serve["args"]["config"]["model"] == "/models/SmolLM2-135M-Instruct"

    off = rendered(chart, AUTOSCALING_OFF)["RayService"][0]
    assert "autoscaling_policy" not in yaml.safe_load(off["spec"]["serveConfigV2"])["applications"][0]

    cpu = rendered(chart, CPU_ONLY)
    config = yaml.safe_load(cpu["RayService"][0]["spec"]["serveConfigV2"])["applications"][0]["args"]["config"]
    assert "model" not in config                          # builtin: the image's default model
    for g in cpu["RayService"][0]["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        spec = g["template"]["spec"]
        assert "nvidia.com/gpu" not in spec["containers"][0]["resources"]["limits"] and "tolerations" not in spec

    large = rendered(chart, LARGE_GPU)
    config = ClusterConfig.from_dict(yaml.safe_load(large["RayService"][0]["spec"]["serveConfigV2"])
                                     ["applications"][0]["args"]["config"])
    for pool, tp in (("prefill", 4), ("decode", 8)):        # one GPU bundle per rank, on the pool's own pods
        bundles = config.deployment_options(pool)["placement_group_bundles"]
        assert [b.get("GPU") for b in bundles] == [1] * tp and bundles[0][f"baton_{pool}"] == 1
    ray = large["RayService"][0]["spec"]["rayClusterConfig"]
    prefill = next(g for g in ray["workerGroupSpecs"] if g["groupName"] == "prefill")
    assert prefill["replicas"] == 4 and prefill["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert prefill["template"]["spec"]["volumes"] == [{"name": "model", "persistentVolumeClaim": {
        "claimName": "llama-70b", "readOnly": True}}]
    env = prefill["template"]["spec"]["containers"][0]["env"]
    assert env == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                   *({"name": k, "value": v} for k, v in sorted(SERVE_ENV.items())),
                   {"name": "BATON_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "baton-keys", "key": "api-keys"}}}]
    head_env = ray["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    assert head_env == env                                    # the ingress (head or any pod) checks the keys
    (monitor,) = large["ServiceMonitor"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (dashboard,) = large["ConfigMap"]
    assert json.loads(dashboard["data"]["baton.json"])["uid"] == "baton"


def test_every_ray_pod_runs_serve_as_baton_serve_does_unless_told_otherwise(chart):
    """Serve reads its throughput-optimized mode from each process's environment: the head (controller, proxy,
    ingress) and every worker pod get `baton serve`'s SERVE_ENV; ray.env changes it for all of them."""
    def envs(values: dict) -> list[dict[str, str]]:
        ray = rendered(chart, values)["RayService"][0]["spec"]["rayClusterConfig"]
        pods = [ray["headGroupSpec"], *ray["workerGroupSpecs"]]
        return [{e["name"]: e.get("value") for e in p["template"]["spec"]["containers"][0]["env"]} for p in pods]
    default = envs({})
    assert len(default) == 3 and all(env == SERVE_ENV for env in default)
    off = envs({"ray": {"env": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}}})
    assert all(env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0" and env["RAY_SERVE_LOG_TO_STDERR"] == "1" for env in off)


@pytest.mark.parametrize("values, message", [
    ({"cluster": {"decode": {"autoscaling": {"max_replica": 4}}}}, "max_replica"),
    ({"ray": {"env": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": 1}}}, "/ray/env/RAY_SERVE_THROUGHPUT_OPTIMIZED"),
    ({"cluster": {"transfer": {"backend": "rdma"}}}, "/cluster/transfer/backend"),
    ({"cluster": {"decode": {"num_gpus": -1}}}, "/cluster/decode/num_gpus"),
    ({"cluster": {"decode": {"autoscaling": {"hysteresis": 1}}}}, "/cluster/decode/autoscaling/hysteresis"),
    ({"model": {"source": "s3"}}, "/model/source"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"ray": {"workers": {"decode": {"resources": {"cpu": "lots", "memory": "1Gi"}}}}},
     "/ray/workers/decode/resources/cpu"),
    ({"service": {"port": 70000}}, "/service/port"),
    ({"replicas": 3}, "replicas"),
])
def test_bad_values_are_refused_at_install_time_naming_the_key(chart, values, message):
    with pytest.raises(helm.HelmError) as e:
        chart.render(values, name="baton", namespace="llm", is_install=True)
    assert "schema" in str(e.value).lower() and message in str(e.value)


@pytest.mark.parametrize("pool, values, message", [
    ("decode", {"num_gpus": 8}, "cluster.decode.num_gpus: 8 but cluster.decode.engine.tensor_parallel_size is 1"),
    ("prefill", {"num_gpus": 4, "engine": {"tensor_parallel_size": 2}},
     "cluster.prefill.num_gpus: 4 but cluster.prefill.engine.tensor_parallel_size is 2"),
    ("decode", {"num_gpus": 1, "engine": {"tensor_parallel_size": 8}},
     "cluster.decode.num_gpus: 1 but cluster.decode.engine.tensor_parallel_size is 8"),
])
def test_gpus_per_replica_other_than_the_tp_size_are_refused_at_install_time(chart, pool, values, message):
    with pytest.raises(helm.HelmError) as e:
        chart.render({"cluster": {pool: values}}, name="baton", namespace="llm", is_install=True)
    assert message in str(e.value)
    fine = {"cluster": {pool: {**values, "num_gpus": values.get("engine", {}).get("tensor_parallel_size", 1)}}}
    assert rendered(chart, fine)["RayService"]                          # the same values with GPUs = TP render
    assert rendered(chart, {"cluster": {"decode": {"num_gpus": 0.5}}})["RayService"]   # TP 1 may share a GPU


def test_a_volume_model_without_a_claim_is_refused(chart):
    with pytest.raises(helm.HelmError, match="model.volume.claimName is required"):
        chart.render({"model": {"source": "volume"}}, name="baton", namespace="llm", is_install=True)


def test_values_schema_is_generated_from_the_cluster_config():
    assert SCHEMA_PATH.read_text() == render(), "stale: run python -m cluster.helm_schema"


def test_the_dashboard_queries_only_metrics_baton_exports():
    dashboard = json.loads((CHART / "dashboards" / "baton.json").read_text())
    assert (ROOT / "deploy" / "grafana" / "baton-dashboard.json").resolve() == (CHART / "dashboards" / "baton.json")
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    used = {m for e in exprs for m in re.findall(r"\b(baton_[a-z0-9_]+)", e)}
    source = "\n".join(p.read_text() for d in ("router", "replica", "prefill_worker", "decode_worker", "cluster")
                       for p in (ROOT / d).glob("*.py"))
    declared = set(re.findall(r'"(baton_[a-z0-9_]+)"', source))
    def base(m: str) -> str:
        return re.sub(r"_(total|bucket|sum|count|created)$", "", m)
    missing = {m for m in used if m not in declared and base(m) not in declared}
    assert not missing, f"the dashboard queries metrics nobody exports: {sorted(missing)}"
    assert {"baton_autoscaling_target_replicas", "baton_time_to_first_token_seconds_bucket",
            "baton_kv_blocks_used"} <= used
