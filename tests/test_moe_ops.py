"""The fused MoE kernel (engine/moe_ops.py) against a per-expert loop, in the Triton interpreter on CPU (fp32: the
interpreter's bf16 tl.dot is wrong; `baton check gpu` runs it in bf16 on a GPU)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported: CPU interpreter

import pytest
import torch
import torch.nn.functional as F

from engine.moe_ops import align_pairs, fused_moe

E, H, INTER = 4, 32, 24            # 2I = 48 and H = 32: output tiles of 16 cut both, K tiles of 16 cut I = 24


def loop_reference(x, w13, w2, weights, experts):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = (w13[e] @ x[t]).split(w13.shape[1] // 2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def _case(tokens: int, top_k: int, seed: int, experts: torch.Tensor | None = None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    w13, w2 = torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5, torch.randn(E, H, INTER, generator=g) / INTER ** 0.5
    if experts is None:
        experts = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return x, w13, w2, weights, experts


@pytest.mark.parametrize("tokens, top_k", [(1, 2), (5, 2), (19, 3), (40, 1)])
def test_fused_moe_equals_the_loop(tokens, top_k):
    x, w13, w2, weights, experts = _case(tokens, top_k, seed=tokens)
    got = fused_moe(x, w13, w2, weights, experts, block_m=16, block_n=16, block_k=16)
    torch.testing.assert_close(got, loop_reference(x, w13, w2, weights, experts), atol=1e-5, rtol=1e-5)


def test_experts_with_no_tokens_and_with_several_blocks_of_them():
    """Expert 2 takes every token (40 pairs: three blocks, the last padded), expert 3 none, experts 0 and 1 the
    other choice in turn."""
    experts = torch.tensor([[2, t % 2] for t in range(40)])
    x, w13, w2, weights, experts = _case(40, 2, seed=7, experts=experts)
    got = fused_moe(x, w13, w2, weights, experts, block_m=16, block_n=16, block_k=16)
    torch.testing.assert_close(got, loop_reference(x, w13, w2, weights, experts), atol=1e-5, rtol=1e-5)


def test_expert_parallel_ranks_sum_to_the_whole():
    """Two ranks of whole experts (0-2 and 3, E = 4): each adds its experts' terms; their sum is the whole."""
    x, w13, w2, weights, experts = _case(19, 2, seed=3)
    kw = dict(block_m=16, block_n=16, block_k=16)
    first = fused_moe(x, w13[:3], w2[:3], weights, experts, **kw)
    second = fused_moe(x, w13[3:], w2[3:], weights, experts, expert_start=3, **kw)
    torch.testing.assert_close(first + second, loop_reference(x, w13, w2, weights, experts), atol=1e-5, rtol=1e-5)
    ids, block_expert = align_pairs(experts - 3, num_experts=1, block_m=16)      # the second rank's view
    n = experts.numel()
    assert sorted(ids[ids < n].tolist()) == (experts.flatten() == 3).nonzero().flatten().tolist()


def test_aligned_pairs_cover_every_pair_once_in_blocks_of_one_expert():
    experts = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 1], [1, 2]])
    ids, block_expert = align_pairs(experts, num_experts=4, block_m=4)
    n = experts.numel()
    assert ids.numel() == 12 + 4 * 3 and ids.numel() % 4 == 0          # the bound: T k + E (block_m - 1)
    assert sorted(ids[ids < n].tolist()) == list(range(n))
    flat = experts.flatten()
    for b, e in enumerate(block_expert.tolist()):
        block = ids[4 * b:4 * (b + 1)]
        real = block[block < n]
        if e < 0:
            assert real.numel() == 0                                 # past the last real block
        else:
            assert real.numel() > 0 and (flat[real] == e).all()
            assert real.tolist() == sorted(real.tolist())            # tokens in order within an expert
    assert block_expert.tolist() == [0, 1, 2, 2, -1, -1]                  # 2, 3, 5 pairs; expert 3 none


def test_an_engine_on_the_fused_kernel_gives_the_loops_tokens(tmp_path, monkeypatch):
    """SparseMoE's CUDA path, run in the interpreter: a tiny Qwen3-MoE's greedy tokens are the loop's (up to a
    near-tie: the kernel sums a token's experts in its top-k order, the loop by expert)."""
    from bench.models import make_tiny_checkpoint
    from engine import LLM, SamplingParams
    from engine import model as model_module
    from tests.greedy import TOP_K, baton_greedy, check_greedy_close
    path = make_tiny_checkpoint(tmp_path, "qwen3_moe", moe_intermediate_size=64)
    prompts = [list(range(10, 40)), [7, 8, 9] * 5]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=TOP_K)
    loop = LLM(path, num_kv_blocks=32, max_model_len=128).generate(prompts, params)
    from engine import moe_ops
    calls = []
    real = moe_ops.fused_moe
    monkeypatch.setattr(model_module, "FUSED_MOE", True)
    monkeypatch.setattr(moe_ops, "fused_moe", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fused = LLM(path, num_kv_blocks=32, max_model_len=128).generate(prompts, params)
    assert calls                                                       # the kernel ran, not the loop
    for f, want in zip(fused, loop):
        check_greedy_close(baton_greedy(f), baton_greedy(want))


def test_gpt_oss_biases_and_gate_in_the_fused_kernel():
    """gpt-oss's experts: a bias on gate/up and on down (added before the routing weight) and its clamped SwiGLU,
    against the loop written out; expert-parallel ranks still sum to the whole (each adds its experts' biases)."""
    x, w13, w2, weights, experts = _case(19, 2, seed=11)
    g = torch.Generator().manual_seed(12)
    b13, b2 = torch.randn(E, 2 * INTER, generator=g), torch.randn(E, H, generator=g)

    def act(gate_up):
        gate, up = gate_up.split(INTER, dim=-1)
        gate, up = gate.clamp(max=1.5), up.clamp(-1.5, 1.5)        # a limit low enough to bite
        return (up + 1) * gate * torch.sigmoid(1.702 * gate)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            want[t] += weights[t, j] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e])
    kw = dict(block_m=16, block_n=16, block_k=16, activation=act)
    got = fused_moe(x, w13, w2, weights, experts, b13=b13, b2=b2, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    halves = [fused_moe(x, w13[:3], w2[:3], weights, experts, b13=b13[:3], b2=b2[:3], **kw),
              fused_moe(x, w13[3:], w2[3:], weights, experts, expert_start=3, b13=b13[3:], b2=b2[3:], **kw)]
    torch.testing.assert_close(halves[0] + halves[1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_gpt_oss_engine_on_the_fused_kernel_gives_the_loops_tokens(tmp_path, monkeypatch):
    """SparseMoE's CUDA path for gpt-oss (its biases and gate through the fused kernel), in the interpreter."""
    from bench.models import make_tiny_checkpoint
    from engine import LLM, SamplingParams
    from engine import model as model_module
    from tests.greedy import TOP_K, baton_greedy, check_greedy_close
    path = make_tiny_checkpoint(tmp_path, "gpt_oss")
    prompts = [list(range(10, 40)), [7, 8, 9] * 5]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=TOP_K)
    loop = LLM(path, num_kv_blocks=32, max_model_len=128).generate(prompts, params)
    from engine import moe_ops
    calls, real = [], moe_ops.fused_moe
    monkeypatch.setattr(model_module, "FUSED_MOE", True)
    monkeypatch.setattr(moe_ops, "fused_moe", lambda *a, **kw: calls.append(kw.get("b13") is not None) or real(*a, **kw))
    fused = LLM(path, num_kv_blocks=32, max_model_len=128).generate(prompts, params)
    assert calls and all(calls)                                        # the kernel ran, with the biases
    for f, want in zip(fused, loop):
        check_greedy_close(baton_greedy(f), baton_greedy(want))
