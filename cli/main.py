"""The `baton` command: generate with the engine, serve the cluster, run benchmarks, check a GPU."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

# name -> (module, help); a bench's module is imported only when that bench runs: some import Ray and the
# cluster code at load, which `baton generate` and `baton check gpu` must not need
BENCHES = {
    "engine": ("bench.engine_bench", "engine throughput and latency against transformers"),
    "spec": ("bench.spec_bench", "batch-1 inter-token latency with and without speculative decoding"),
    "eagle-head": ("bench.eagle_head", "train a small EAGLE-3 head for a model on its own text (for `bench spec "
                                       "--method eagle3`): its held-out first-draft accuracy"),
    "transfer": ("bench.transfer_bench", "one request's KV between two processes: NIXL vs the Ray fallback vs a copy"),
    "cluster": ("bench.cluster_bench", "open-loop HTTP load: prefix-aware vs pow2 routing, disaggregated vs colocated"),
    "autoscale": ("bench.autoscale_bench", "coupled vs independent pool autoscaling on a load step (fluid model)"),
    "peer": ("bench.peer_bench", "Baton vs llama.cpp's server on the same GGUF: decode, prefill, 16 streams"),
    "soak": ("bench.soak_bench", "thousands of mixed requests, then zero leaked KV blocks, no restarts, memory"),
    "chaos": ("bench.chaos_bench", "open-loop load while replicas die, KV pulls fail, pools scale and roll"),
    "router": ("bench.router_bench", "prefill routing decision time with a large prefix index"),
    "replay": ("bench.replay_bench", "replay a request trace (Mooncake's or Baton's JSONL) open-loop against the "
                                     "HTTP API: goodput under SLOs, prefix hit rate, TTFT/ITL"),
}

PLANS = {
    "calibrate": ("plan.calibrate", "fit the simulator's step cost model to this machine's engine step timings"),
    "validate": ("plan.validate", "run `baton bench` workloads here and in the simulator: the errors of each figure"),
    "search": ("plan.search", "the cheapest prefill:decode replica counts (and colocated) for a trace under SLOs, "
                              "and the autoscaler over a day of it"),
}


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, BatonError, SamplingParams
    from router.config import chat_template_text
    try:
        template = chat_template_text(args.chat_template) if args.chat_template else None
    except ValueError as e:                              # neither a file nor a template
        print(f"baton: error: --chat-template: {e}", file=sys.stderr)
        return 2
    try:
        spec = json.loads(args.speculative_config) if args.speculative_config else None
        llm = LLM(args.model, max_model_len=args.max_model_len, speculative_config=spec,
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                seed=args.seed)
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.prompt}]
        out = llm.chat(messages, params, template) if not args.raw else llm.generate([args.prompt], params)[0]
    except json.JSONDecodeError as e:
        print(f"baton: error: --speculative-config is not valid JSON: {e}", file=sys.stderr)
        return 2
    except BatonError as e:
        print(f"baton: error: {e}", file=sys.stderr)
        return 2
    print(out.text)
    m = out.metrics
    spec = (f", {m.spec_num_accepted_tokens}/{m.spec_num_draft_tokens} drafts accepted"
            if m.spec_num_draft_tokens else "")
    print(f"[{m.num_output_tokens} tokens, finish={out.finish_reason}, ttft={m.ttft * 1e3:.0f} ms, "
          f"{(m.time_per_output_token or 0) * 1e3:.1f} ms/token{spec}]", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Start Ray locally unless one is running (RAY_ADDRESS / `ray start`), deploy the app, serve until ^C."""
    import time

    from engine import BatonError
    try:
        from cluster.config import ClusterConfig
        config = ClusterConfig.from_yaml(args.config) if args.config else ClusterConfig()
        config = config.with_overrides(model=args.model, prefill_replicas=args.prefill_replicas,
                                       decode_replicas=args.decode_replicas, port=args.port,
                                       chat_template=args.chat_template,
                                       trust_request_chat_template=args.trust_request_chat_template)
    except BatonError as e:
        print(f"baton: error: {e}", file=sys.stderr)
        return 2
    if args.print_serve_config:         # for `serve deploy` on an existing cluster, or KubeRay's serveConfigV2
        import yaml

        from cluster.app import serve_config
        print(yaml.safe_dump(serve_config(config), sort_keys=False), end="")
        return 0
    from cluster.serving import start
    start(config)
    print(f"baton: serving {config.model_name()} ({config.mode}) on http://{config.host}:{config.port}/v1 "
          f"- Ctrl-C to stop", file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        from cluster.serving import stop
        stop()
    return 0


def _bench(args: argparse.Namespace) -> int:
    """With --json, stdout is the result alone: whatever the run prints there (Ray echoes its workers' and
    raylet's messages to the driver's stdout) goes to stderr instead, so `... --json | jq` always parses."""
    import contextlib
    if not args.json:
        args.bench_fn(args)
        return 0
    with contextlib.redirect_stdout(sys.stderr):
        result = args.bench_fn(args)
    print(json.dumps(result, indent=2))
    return 0


def _dev_cluster(args: argparse.Namespace) -> int:
    from cluster.netns import NetnsCluster
    cluster = NetnsCluster(nodes=args.nodes, name=args.name, cpus_per_node=args.cpus_per_node)
    if args.down:
        cluster.down()
        print(f"{args.name}: stopped, namespaces deleted")
        return 0
    if args.nodes < 1:
        print("--nodes must be at least 1", file=sys.stderr)
        return 2
    cluster.up()
    for i in range(args.nodes):
        print(f"node {i}: namespace {cluster.ns(i)}, address {cluster.ip(i)}, resource baton_node_{i}")
    print(f"head: {cluster.address}. Run a command on node i with: ip netns exec {cluster.ns(0)} <command> "
          f"(with RAY_ADDRESS={cluster.address} RAY_AUTH_MODE=disabled); place a pool on node i with its "
          f"`resources: {{baton_node_i: 1}}`. Stop it: baton dev cluster --down --name {args.name}")
    return 0


def _check_gpu(args: argparse.Namespace) -> int:
    from check.gpu import run
    return run(args)


def build_parser(bench: str | None = None, plan: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; only the bench (or plan command) named (if any) has its arguments, so only its module
    loads."""
    p = argparse.ArgumentParser(prog="baton", description="Disaggregated LLM serving on Ray.")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine start-up details")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt with the chat template (default model: SmolLM2-135M-Instruct)")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--system", default=None, help="optional system message")
    g.add_argument("--raw", action="store_true", help="no chat template: complete the text as is")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.9)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--quantization", default="auto",
                   help="weights: auto (a GGUF, the default model included, or a GPTQ/AWQ/FP8/compressed-tensors "
                        "checkpoint runs packed), none (fp32), gguf, gptq, awq, compressed-tensors, int8 (quantized "
                        "at load), fp8")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="KV cache: auto (the model's dtype), int8 or fp8 (a byte a value, a scale per token and head)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM-style, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="a Jinja chat template (a file or its text) in place of the model's")
    g.set_defaults(fn=_generate)

    sv = sub.add_parser("serve", help="serve the OpenAI-compatible API from a local Ray cluster (port 8000)")
    sv.add_argument("--config", default=None, help="cluster YAML (see deploy/cluster.yaml); default: built-in")
    sv.add_argument("--model", default=None, help="model for both pools (default: the config's, or SmolLM2)")
    sv.add_argument("--prefill-replicas", type=int, default=None, help="fixed prefill replica count")
    sv.add_argument("--decode-replicas", type=int, default=None, help="fixed decode replica count")
    sv.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    sv.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                    help="chat.template: a Jinja chat template (a file or its text) in place of the model's")
    sv.add_argument("--trust-request-chat-template", action="store_true", default=None,
                    help="chat.trust_request_template: run a chat_template a request brings (else a 400)")
    sv.add_argument("--print-serve-config", action="store_true",
                    help="print the Serve config (serve deploy / serveConfigV2) of this cluster and exit")
    sv.set_defaults(fn=_serve)

    for command, text, table, chosen in (("bench", "benchmarks (JSON out, PNG plots)", BENCHES, bench),
                                         ("plan", "size a cluster with the discrete-event simulator (plan/sim.py)",
                                          PLANS, plan)):
        group = sub.add_parser(command, help=text).add_subparsers(dest=command, required=True)
        for name, (module_name, text) in table.items():
            sp = group.add_parser(name, help=text, add_help=name == chosen)
            if name == chosen:                       # only the command that runs imports its module
                module = importlib.import_module(module_name)
                module.add_arguments(sp)
                sp.set_defaults(fn=_bench, bench_fn=module.run)

    d = sub.add_parser("dev", help="development tools")
    dsub = d.add_subparsers(dest="dev", required=True)
    dc = dsub.add_parser("cluster", help="a multi-node Ray cluster on this machine: one network namespace per node "
                                         "(needs root; cluster/netns.py)")
    dc.add_argument("--nodes", type=int, default=3, help="Ray nodes, the head included (default 3)")
    dc.add_argument("--name", default="baton-mn", help="namespace prefix (default baton-mn)")
    dc.add_argument("--cpus-per-node", type=int, default=2)
    dc.add_argument("--down", action="store_true", help="stop that cluster and delete its namespaces")
    dc.set_defaults(fn=_dev_cluster)

    c = sub.add_parser("check", help="checks on this machine's hardware")
    csub = c.add_subparsers(dest="check", required=True)
    from check.gpu import add_arguments
    cg = csub.add_parser("gpu", help="the CUDA path on one NVIDIA GPU: attention kernel, engine vs transformers, "
                                     "speed, KV pull (table + JSON; --cpu: dry mode)")
    add_arguments(cg)
    cg.set_defaults(fn=_check_gpu)
    return p


def main(argv: list[str] | None = None) -> int:
    # first pass: which bench, if any, without importing a bench module; second: the full parse
    known, _ = build_parser().parse_known_args(argv)
    args = build_parser(getattr(known, "bench", None), getattr(known, "plan", None)).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("engine").setLevel(logging.INFO)     # start-up report: KV blocks, memory, load time
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
