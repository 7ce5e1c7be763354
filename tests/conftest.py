"""Shared fixtures: the default model (converted once), tiny random HF checkpoints, engines, the Ray clusters
the cluster tests share, the `cluster` marker, and wait_for (tests poll a condition, never sleep a fixed time)."""
from __future__ import annotations

import functools
import json
import os
import re
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

os.environ.setdefault("TRITON_INTERPRET", "1")   # no GPU in CI: Triton kernels run in the interpreter
# gRPC's fork handlers off (before anything imports grpc). A test process starts Ray many times, forking the GCS
# and the raylet. With a finished session's gRPC threads still in a call, grpcio skipped its handlers ("Other
# threads are currently calling into gRPC, skipping fork() handlers") and the child never ran the GCS binary (no
# log, no port file): both tries of one start, 2026-11-28; the raylet's rare silent starts look the same. Known
# upstream (grpc/grpc#17986, #37259). This process forks only to exec, which needs none of the handlers.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest

from bench.models import make_tiny_checkpoint  # noqa: F401 - the tests' tiny checkpoints, shared with benches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -- how slow this machine runs today ---------------------------------------------------------------------
# The tests' waits (wait_for, run_bench) were sized on the 2-core VM CI runs on, on a normal day. The same VM
# has run for a day at 3 to 12 times that slowness (docs/benchmarks.md, "where the suite's time goes"): a
# replica then took minutes to start and waits sized for seconds failed tests that had nothing wrong. So each
# wait is stretched by this machine's slowness now, measured once per test process as the time of a million
# Python additions in a function against the 0.05 s they take there (at least 1: a fast machine keeps the sizes;
# at most 10). Waits only ever grow, so a check still fails when its condition never comes. Shown in pytest's
# header. (The 0.15 s first used here was the same loop at module level, where each addition reads and writes a
# global: about three times slower, so slowdowns under 3x stretched nothing. On 2026-11-27 this loop took
# 0.02-0.025 s on an AMD EPYC VM and the module-level one 0.05-0.2 s.)
REFERENCE_LOOP_S = 0.05


def _slowdown() -> tuple[float, float]:
    t0, total = time.perf_counter(), 0
    for i in range(1_000_000):
        total += i
    took = time.perf_counter() - t0
    return took, min(max(took / REFERENCE_LOOP_S, 1.0), 10.0)


LOOP_S, SLOWDOWN = _slowdown()


def _speed_line() -> str:
    return (f"machine speed: a million Python additions in {LOOP_S:.2f} s ({LOOP_S / REFERENCE_LOOP_S:.1f}x the "
            f"{REFERENCE_LOOP_S} s the waits were sized on); waits stretched x{SLOWDOWN:.1f}")


def pytest_report_header(config) -> str:
    return _speed_line()


def pytest_terminal_summary(terminalreporter) -> None:      # also under -q, which hides the header
    terminalreporter.write_line(_speed_line())


def run_bench(*args: str, timeout_s: float = 600) -> dict:
    """`baton bench ARGS --json` as a user runs it (a subprocess from the repository root): its JSON result;
    a failure shows the end of its stderr."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-m", "cli.main", "bench", *args, "--json"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, timeout=timeout_s * SLOWDOWN)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout)


@pytest.fixture(scope="session")
def smol_path() -> str:
    from engine.loader import resolve_model
    return resolve_model(None)


# Engines of one checkpoint in one process share its weights and tokenizer while one of them lives
# (engine/model_runner.py, engine/loader.py). Most tests build an engine of the default model (converted or packed)
# and drop it; the first load of each in a test process is kept here, so the others share it instead of reading and
# repacking 538 MB and parsing the tokenizer again (0.8 s an engine, 130-odd engines in `make test-fast`). The load
# itself is still what each process's first engine runs. Not in the process that runs the Ray tests, beside the
# replicas: it builds few engines of its own.
PINNED_LOADS: list = []


@pytest.fixture(autouse=True)
def _keep_the_default_models_loads(request):
    yield
    import sys
    if request.node.get_closest_marker("cluster"):
        return
    runner = sys.modules.get("engine.model_runner")
    if runner is None:
        return
    from engine import loader
    ours = _default_model_files()
    kept = [shared for key, shared in list(runner._SHARED.items()) if key[0] and key[0][0][0].startswith(ours)]
    kept += [tok for key, tok in list(loader._TOKENIZERS.items()) if (key[0] + os.sep).startswith(ours)]
    PINNED_LOADS.extend(k for k in kept if not any(k is p for p in PINNED_LOADS))


@functools.cache
def _default_model_files() -> tuple[str, str]:
    from engine.loader import gguf_source, resolve_model
    mine = str(Path(resolve_model(None)).resolve())
    gguf = gguf_source(mine)
    return mine + os.sep, str(gguf.resolve()) if gguf else mine


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smol_path, dtype=torch.float32).eval()


def thinking_model(directory: Path, smol_path: str) -> str:
    """SmolLM2 as a reasoning model's tokenizer has it: its two unused special tokens 15 and 16 (<jupyter_script>,
    <empty_output>) renamed <think> and </think>, plain added tokens (not special: their text stays in the output,
    where the reasoning parsers read it), as Qwen3's and DeepSeek-R1's tokenizers have them. The weights and the
    other files are SmolLM2's own (symlinked): the model's text is SmolLM2's, and a logit_bias on 16 makes it
    close its thinking."""
    return renamed_tokens_model(directory, smol_path, {15: "<think>", 16: "</think>"})


def renamed_tokens_model(directory: Path, smol_path: str, names: dict[int, str]) -> str:
    """SmolLM2 with some of its unused special tokens renamed (`names`: id -> text), as plain added tokens (see
    thinking_model; gpt-oss's harmony markers the same way: tests/test_structured_reasoning.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    for f in Path(smol_path).iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            (directory / f.name).symlink_to(f)
    tok = json.loads((Path(smol_path) / "tokenizer.json").read_text())
    for t in tok["added_tokens"]:
        if t["id"] in names:
            t.update(content=names[t["id"]], special=False)
    for word, i in list(tok["model"]["vocab"].items()):
        if i in names:
            del tok["model"]["vocab"][word]
            tok["model"]["vocab"][names[i]] = i
    (directory / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((Path(smol_path) / "tokenizer_config.json").read_text())
    for i, t in cfg.get("added_tokens_decoder", {}).items():
        if int(i) in names:
            t.update(content=names[int(i)], special=False)
    old_names = {t["content"] for i, t in json.loads((Path(smol_path) / "tokenizer_config.json").read_text())
                 .get("added_tokens_decoder", {}).items() if int(i) in names}
    cfg["additional_special_tokens"] = [t for t in cfg.get("additional_special_tokens", []) if t not in old_names]
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(directory)


# What the thinking model's tests ask (tests/test_structured_reasoning.py, tests/test_cluster_reasoning.py): a
# logit_bias of THINK_CLOSE_BIAS on </think> makes SmolLM2 close its thinking after its first sentence (at 12 it ends
# with EOS first, from 16 it closes at once), and a schema without free strings keeps the bias out of the answer.
THINK_END, THINK_CLOSE_BIAS = 16, 14
THINK_SCHEMA = {"type": "object", "properties": {"leg": {"enum": ["first", "anchor"]},
                                                 "laps": {"type": "integer", "minimum": 1, "maximum": 8},
                                                 "fast": {"type": "boolean"}},
                "required": ["leg", "laps", "fast"], "additionalProperties": False}
THINK_ASK = [{"role": "user", "content": "Which leg of a relay is the anchor leg? Answer as JSON."}]


@pytest.fixture(scope="session")
def thinking_model_dir(tmp_path_factory, smol_path) -> str:
    return thinking_model(tmp_path_factory.mktemp("thinking"), smol_path)


# Tests of what structured outputs produce, engines and clusters alike, are not about the compile timeout (its
# refusal has its own test in tests/test_structured_output.py, with its own timeout): a cold compile of a JSON
# schema over SmolLM2's vocabulary took over the default 10 s on a slowed machine (14 s) and at idle priority
# beside the Ray tests.
GRAMMAR_COMPILE_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def smol_llm(smol_path):
    from engine import LLM
    return LLM(smol_path, kv_cache_memory=256 << 20, max_model_len=2048, grammar_compile_timeout_s=GRAMMAR_COMPILE_TIMEOUT_S)


def ray_log_files() -> list[str]:
    """The files of this process's Ray session (every replica, the proxy, the controller, the raylet; those of
    processes that have gone stay), once what the replicas logged until now has reached them."""
    import glob

    import ray
    logs = ray._private.worker._global_node.get_logs_dir_path()
    mark = f"baton-test-log-flush-{time.monotonic_ns()}"
    ray.get(ray.remote(num_cpus=0)(lambda m: print(m)).remote(mark))   # a line written now, by a worker

    def log_files() -> list[str]:
        return [f for f in glob.glob(os.path.join(logs, "**", "*"), recursive=True) if os.path.isfile(f)]
    # once it is in a file, what the replicas logged before it is too (each process writes its own files)
    wait_for(lambda: any(mark.encode() in open(f, "rb").read() for f in log_files()), 30, "log lines to reach files")
    files = log_files()
    assert len(files) > 5
    return files


def assert_not_in_ray_logs(*secrets: str) -> None:
    """No file of this process's Ray session holds any of the secrets (prompt text, completions, API keys)."""
    for f in ray_log_files():
        data = open(f, "rb").read()
        for secret in secrets:
            assert secret.encode() not in data, (f, secret)


def count_in_ray_logs(text: str) -> int:
    """How often `text` appears in this Ray session's log files (processes that have gone included)."""
    return sum(open(f, "rb").read().count(text.encode()) for f in ray_log_files())


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    """Poll `condition` until it returns something truthy and return that; fail the test naming `what` once
    `timeout_s` has passed. Tests wait on a condition (a metric, an index version, an actor's state), never
    for a fixed time: a fixed sleep is too short on a loaded machine and wasted on an idle one. `timeout_s` is
    stretched by SLOWDOWN, this machine's slowness now."""
    timeout_s *= SLOWDOWN
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            slow = f" (stretched x{SLOWDOWN:.1f} for this machine's speed)" if SLOWDOWN > 1 else ""
            pytest.fail(f"timed out after {timeout_s:g} s{slow} waiting for {what}", pytrace=False)
        time.sleep(interval_s)


# -- markers -------------------------------------------------------------------------------------------
# `cluster`: the test starts Ray (run it under the Ray lock; `make test-fast` leaves it out). A module whose
# tests all start Ray says so in its pytestmark; a fixture named `cluster` (a module's own Ray) or
# `shared_cluster` (below) marks every test that uses it.
RAY_FIXTURES = {"cluster", "shared_cluster"}


@pytest.hookimpl(tryfirst=True)        # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    default_timeout = float(config.getini("timeout") or 0)
    for item in items:
        if SLOWDOWN > 1:            # pytest-timeout's limit, the module's or the ini's, stretched like the waits
            mark = item.get_closest_marker("timeout")
            limit = float(mark.args[0] if mark and mark.args else default_timeout)
            if limit > 0:
                item.add_marker(pytest.mark.timeout(limit * SLOWDOWN), append=False)
        if RAY_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.cluster)


# Under pytest-xdist (`make test` and `make test-fast` run the tests that start no Ray on two workers) a module's
# tests stay on one worker, so its module fixtures (engines, references) are built once; modules that name an
# XDIST_GROUP share a worker (the tensor-parallel ones: one fork server of TP workers, 6-9 s to start). The scheduler
# is ours, through xdist's hook: xdist's own `--dist loadgroup` renames each item through item._nodeid, which
# pytest 9 no longer reads, so under pytest 9 it grouped nothing (a module's tests ran on both workers, its
# fixtures built twice: SmolLM2's transformers reference, 37 s, in each).
def _xdist_groups() -> dict[str, str]:
    groups = {}
    for f in Path(__file__).parent.glob("test_*.py"):
        m = re.search(r'^XDIST_GROUP = "([^"]+)"', f.read_text(), re.MULTILINE)
        if m:
            groups[f"{Path(__file__).parent.name}/{f.name}"] = m.group(1)
    return groups


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling
    groups = _xdist_groups()

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return groups.get(module, module)
    return ModuleScheduling(config, log)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: one torch thread each, and for the benchmarks they start (OpenMP teams that
    # outnumber the cores spin on each other's cores: a 1.5 ms decode step then takes 80)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch                    # here only: the controlling process never needs torch (2.3 s of its start)
    torch.set_num_threads(1)


# -- the Ray clusters the cluster tests share -----------------------------------------------------------
CLUSTER_ENGINE = {"kv_cache_memory": 96 << 20, "max_model_len": 1024}
TEST_KEYS_ENV, TEST_KEY = "BATON_TEST_API_KEYS", "sk-baton-test-key"
# One prefill and one decode replica of the default model, KV over NIXL, API keys and tight request limits
# (tests/test_cluster_e2e.py), and the baseline its speculative twin below is compared with.
DISAGGREGATED = {
    "port": 8731, "ingress": {"num_cpus": 0},
    "prefill": {"num_cpus": 0, "engine": CLUSTER_ENGINE},
    "decode": {"num_cpus": 0, "engine": CLUSTER_ENGINE, "stream_channels": True},
    "disaggregation": {"min_remote_prefill_tokens": 16},
    "limits": {"max_body_bytes": 256 << 10, "max_n": 4, "max_stop_sequences": 8,
               "grammar_compile_timeout_s": GRAMMAR_COMPILE_TIMEOUT_S},
    "auth": {"api_keys_env": TEST_KEYS_ENV}}
DISAGGREGATED_ENV = {TEST_KEYS_ENV: f"sk-other, {TEST_KEY}"}
# Every pool scaled out or switched to its alternative: two ingress replicas (each with its own mirror of the
# index), two prefill replicas, n-gram speculative decoding in the decode pool, the Ray object-store transport,
# every prompt prefilled remotely (tests/test_cluster_multi.py, tests/test_cluster_ray_transfer.py).
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}     # drafts whenever it can
SCALED_OUT = {
    "port": 8735, "ingress": {"num_replicas": 2, "num_cpus": 0}, "transfer": {"backend": "ray"},
    "prefill": {"num_replicas": 2, "num_cpus": 0, "engine": CLUSTER_ENGINE},
    "decode": {"num_cpus": 0, "engine": {**CLUSTER_ENGINE, "speculative_config": SPECULATIVE}},
    "disaggregation": {"min_remote_prefill_tokens": 0},
    "limits": {"grammar_compile_timeout_s": GRAMMAR_COMPILE_TIMEOUT_S}}


@dataclass
class SharedCluster:
    """One local Ray cluster serving one Baton app at a time. `up(config)` keeps the running app when the test
    asks for the same config (and environment) as the last one, and replaces the whole cluster otherwise, so
    modules that test the same kind of app share its start-up (a minute of replicas loading the model)."""
    key: str | None = None
    config: Any = None

    def up(self, config: dict[str, Any], env: dict[str, str] | None = None, num_cpus: int = 2):
        from cluster.config import ClusterConfig
        from cluster.serving import start
        env = env or {}
        key = json.dumps([config, env], sort_keys=True)
        if key != self.key:
            self.down()
            os.environ.update(env)                  # the local Ray's processes inherit it at start
            try:
                self.config = ClusterConfig.from_dict(config)
                start(self.config, num_cpus=num_cpus)
            finally:
                for name in env:
                    del os.environ[name]
            self.key = key
        return self.config

    def down(self) -> None:
        import ray

        from router.cluster_state import IndexMirror
        IndexMirror.stop_all()          # a test that routed through its own handles started one in this process
        # The whole local Ray goes, the app with it: Serve's graceful shutdown first would only wait (about 3 s
        # of its replicas' drain loops) for processes ray.shutdown() ends anyway.
        self.key = None
        ray.shutdown()


def _no_ray_auto_init() -> None:
    """This process starts Ray only where a test or fixture calls ray.init. A Serve handle a test made here keeps
    a long-poll client on its own thread, which Serve never stops; when the shared cluster goes down under it,
    its next poll would otherwise start a fresh local Ray (Ray's auto-init), and the next module's ray.init then
    fails with "called ray.init twice". The switch is RAY_ENABLE_AUTO_CONNECT=0 as Ray reads it at import
    (ray._private.auto_init_hook, checked against Ray 2.60); set here rather than in the environment so that the
    benchmarks the tests start as subprocesses run as users run them."""
    import ray._private.auto_init_hook as hook
    hook.enable_auto_connect = False


_no_ray_auto_init()
# A local Ray's start waits 30 s (Ray's default) for its GCS to publish its port. Once, with the tests that start
# no Ray running beside (`make test`), a GCS had not published it in that time and the test's ray.init failed;
# the tests allow it two minutes (RAY_gcs_server_port_wait_time_s, Ray's own setting; its subprocesses inherit it).
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")


@pytest.fixture(scope="session")
def shared_cluster():
    cluster = SharedCluster()
    yield cluster
    cluster.down()


@pytest.fixture(scope="module", autouse=True)
def _one_ray_at_a_time(request):
    """Ray is one per process: before a module that starts a Ray of its own, the shared cluster goes down; after
    the last module that uses it, too (its replicas would otherwise idle beside the tests that follow)."""
    items = request.session.items
    mine = [i for i in items if i.module is request.module]

    def uses_shared(some) -> bool:
        return any("shared_cluster" in i.fixturenames for i in some)
    if not uses_shared(mine):
        if any(i.get_closest_marker("cluster") for i in mine):
            request.getfixturevalue("shared_cluster").down()
        yield
        return
    shared = request.getfixturevalue("shared_cluster")
    yield
    if not uses_shared(items[items.index(mine[-1]) + 1:]):
        shared.down()


def on_ingress_replicas(fn: Callable[[], Any], app: str = "baton") -> dict[str, Any]:
    """fn() run inside every ingress replica's process, by replica actor name: what that process's routers see
    (its IndexMirror, its own metrics). Ray's `__ray_call__` (a DeveloperAPI) runs a closure in an actor, and
    Serve's replicas are actors, so no test-only route is needed. fn must be a lambda or a nested function
    (cloudpickle sends those by value; the workers cannot import a test module)."""
    import ray
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith(f"SERVE_REPLICA::{app}#ingress#"))
    refs = [ray.get_actor(n, namespace="serve").__ray_call__.remote(lambda _replica: fn()) for n in names]
    return dict(zip(names, ray.get(refs, timeout=30)))


def ingress_index_matches(pool: str, hashes: list[int]) -> dict[str, dict[str, int] | None]:
    """Per ingress replica: the leading blocks of `hashes` each replica of `pool` caches, as that ingress's own
    mirror of the prefix index has it (what its routers decide on); None before its first request made one."""
    def match() -> dict[str, int] | None:
        from router.cluster_state import IndexMirror
        mirrors = list(IndexMirror._shared.values())   # one per process: the ingress and its routers share it
        return mirrors[0].index[pool].match(hashes) if mirrors else None
    return on_ingress_replicas(match)


def served_model_key(app: str = "baton") -> str:
    """The model key block hashes of this app's prompts use (from a decode replica)."""
    from ray import serve
    return serve.get_deployment_handle("decode", app).model_info.remote().result()["model_key"]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Keep faulthandler on through the interpreter's exit, after pytest's own plugin turns it off: the process of
    the tests that start Ray once died of a segmentation fault after its summary (2026-11-29, after "76 passed",
    exit 139; the cause not found). A next one prints every thread's stack."""
    import faulthandler
    import sys
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
