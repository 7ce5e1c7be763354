"""The C++ CPU attention kernel (decode and short variable-length queries) equals the torch
reference on the real strided cache layout.

`python -m tests.test_cpu_attention` prints timings of one attention layer (kernel vs reference).
"""
from __future__ import annotations

import pytest
import torch

from engine import cpu_attention
from engine.attention import SHORT_QUERY, AttentionMetadata, paged_attention_torch
from engine.kv_layout import kv_cache_shape, layer_views


def _batch(lens, heads, kv_heads, head_dim, block_size=16, num_blocks=128, layers=3, layer=1, seed=0,
           qlens=None):
    """Sequences with contexts `lens`, each ending in its `qlens` (default 1) query tokens; K/V as a
    layer's strided views of the real cache tensor (engine/kv_layout.py)."""
    qlens = list(qlens or [1] * len(lens))
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = max(num_blocks, len(lens) * max_blocks)
    kv = torch.randn(kv_cache_shape(num_blocks, kv_heads, layers, block_size, head_dim), generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[:len(lens) * max_blocks].view(len(lens), max_blocks).int()
    q = torch.randn(sum(qlens), heads, head_dim, generator=g)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    md = AttentionMetadata(slot_mapping=torch.zeros(len(q), dtype=torch.int64), block_tables=tables,
                           seq_lens=torch.tensor(lens, dtype=torch.int32),
                           query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                           max_query_len=max(qlens), max_seq_len=max(lens), seq_lens_list=list(lens),
                           query_lens_list=qlens)
    return q, *layer_views(kv, layer), md


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_attention.available(), "the C++ kernel did not compile on this machine"


@pytest.mark.parametrize("lens,heads,kv_heads,head_dim", [
    ([1, 17, 300, 64], 9, 3, 64),       # SmolLM2's shape: GQA group of 3
    ([5, 33], 4, 4, 32),                # MHA
    ([250], 8, 1, 128),                 # MQA, one long sequence
])
def test_kernel_matches_reference(lens, heads, kv_heads, head_dim):
    q, k, v, md = _batch(lens, heads, kv_heads, head_dim)
    want = paged_attention_torch(q, k, v, md, head_dim ** -0.5)
    got = paged_attention_torch(q, k, v, md, head_dim ** -0.5, decode_kernel=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    direct = cpu_attention.paged_decode_attention(q, k, v, md.block_tables, md.seq_lens, head_dim ** -0.5)
    torch.testing.assert_close(direct, want, atol=2e-5, rtol=2e-5)


def test_kernel_in_a_mixed_batch_with_a_prefill_chunk():
    q, k, v, md = _batch([40, 70], 9, 3, 64)
    # make sequence 1 a 6-token chunk continuing a cached prefix: queries rows 1..6
    q = torch.cat([q[:1], torch.randn(6, 9, 64)])
    md.query_lens_list, md.max_query_len = [1, 6], 6
    md.query_start_loc = torch.tensor([0, 1, 7], dtype=torch.int32)
    want = paged_attention_torch(q, k, v, md, 0.125)
    got = paged_attention_torch(q, k, v, md, 0.125, decode_kernel=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("lens,qlens,heads,kv_heads,head_dim,block_size", [
    # decodes, verify steps of 3/5/9 tokens, a 16-token query; a 5- and a 16-token fresh prompt
    # (context == query length); contexts crossing block boundaries, a 1-token context
    ([1, 40, 5, 300, 17, 16], [1, 3, 5, 9, 1, 16], 9, 3, 64, 16),     # SmolLM2: GQA 9/3, D 64
    ([33, 7, 129, 2, 700], [2, 7, 4, 2, 5], 8, 2, 128, 16),           # GQA 8/2, D 128
    ([50, 9, 100, 12], [3, 9, 1, 12], 4, 4, 32, 8),                   # MHA, small blocks
    ([64, 31], [16, 4], 6, 1, 48, 32),                                # MQA, big blocks, D 48
])
def test_varlen_kernel_matches_reference(lens, qlens, heads, kv_heads, head_dim, block_size):
    q, k, v, md = _batch(lens, heads, kv_heads, head_dim, block_size=block_size, qlens=qlens)
    want = paged_attention_torch(q, k, v, md, head_dim ** -0.5)
    got = cpu_attention.paged_attention_varlen(q, k, v, md.block_tables, md.seq_lens, md.query_start_loc,
                                               head_dim ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    via = paged_attention_torch(q, k, v, md, head_dim ** -0.5, decode_kernel=True)
    torch.testing.assert_close(via, got, atol=0, rtol=0)


def test_all_short_batch_goes_to_the_kernel_without_a_copy(monkeypatch):
    q, k, v, md = _batch([20, 300], 9, 3, 64, qlens=[5, 9])
    calls = []
    real = cpu_attention.paged_attention_varlen

    def spy(q_, *args):
        calls.append(q_)
        return real(q_, *args)

    monkeypatch.setattr(cpu_attention, "paged_attention_varlen", spy)
    paged_attention_torch(q, k, v, md, 0.125, decode_kernel=True)
    assert len(calls) == 1 and calls[0] is q


def test_short_queries_and_a_long_chunk_in_one_batch(monkeypatch):
    # a 40-token chunk on a 60-token cached prefix and a fresh 17-token prompt (both > SHORT_QUERY)
    # among decodes and verify steps
    lens, qlens = [30, 100, 64, 200, 17, 700], [1, 40, 5, 9, 17, 1]
    q, k, v, md = _batch(lens, 9, 3, 64, qlens=qlens)
    seen = []
    real = cpu_attention.paged_attention_varlen

    def spy(q_, k_, v_, bt, sl, qsl, scale, *scales):
        seen.append((sl.tolist(), qsl.tolist()))
        return real(q_, k_, v_, bt, sl, qsl, scale, *scales)

    monkeypatch.setattr(cpu_attention, "paged_attention_varlen", spy)
    want = paged_attention_torch(q, k, v, md, 0.125)
    got = paged_attention_torch(q, k, v, md, 0.125, decode_kernel=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    short = [i for i, n in enumerate(qlens) if n <= SHORT_QUERY]
    assert seen == [([lens[i] for i in short], [0, 1, 6, 15, 16])]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 1, 128, 32)])
def test_a_prompt_is_the_same_bits_however_its_rows_are_split(heads, kv_heads, head_dim, block_size):
    """A prompt's rows skip the cached tokens they may not see and are cut into chunks of equal causal work (more
    chunks with more threads). A row's output is the same bits with 1 thread or 2, and when the prompt comes as
    two chunked-prefill calls (the second on the first's cached KV) beside a decode, as the scheduler may cut it."""
    lens, qlens = [300, 57], [300, 1]
    q, k, v, md = _batch(lens, heads, kv_heads, head_dim, block_size=block_size, qlens=qlens)
    want = paged_attention_torch(q, k, v, md, head_dim ** -0.5)

    def kernel(q_, seq_lens, qsl, tables=md.block_tables):
        return cpu_attention.paged_attention_varlen(q_, k, v, tables, torch.tensor(seq_lens, dtype=torch.int32),
                                                    torch.tensor(qsl, dtype=torch.int32), head_dim ** -0.5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, lens, [0, 300, 301])
        torch.set_num_threads(2)
        two = kernel(q, lens, [0, 300, 301])
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(two, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(one, two)
    first = kernel(q[:137], [137], [0, 137], md.block_tables[:1])                    # tokens 0-136 of the prompt
    rest = kernel(torch.cat([q[137:300], q[300:]]), [300, 57], [0, 163, 164])     # 137-299, then the decode
    assert torch.equal(torch.cat([first, rest]), two)


def test_kernel_rejects_bad_metadata():
    q, k, v, md = _batch([4, 10], 9, 3, 64, qlens=[5, 1])              # 5 queries on a 4-token context
    with pytest.raises(RuntimeError, match="query tokens"):
        cpu_attention.paged_attention_varlen(q, k, v, md.block_tables, md.seq_lens, md.query_start_loc, 0.125)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_attention.paged_attention_varlen(q.double(), k, v, md.block_tables, md.seq_lens,
                                             md.query_start_loc, 0.125)
    with pytest.raises(RuntimeError, match="a quantized cache comes with its scales"):
        cpu_attention.paged_attention_varlen(q, k.to(torch.int8), v.to(torch.int8), md.block_tables, md.seq_lens,
                                             md.query_start_loc, 0.125)


def _timings():
    """One attention layer, SmolLM2's heads (9 / 3 kv, D 64), 30-layer cache, contexts ~700."""
    import time

    def best_ms(fn, reps=20):
        fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts) * 1e3

    for seqs, n in [(32, 5), (1, 5), (64, 1), (1, 1)]:
        lens = [700 + (7 * i) % 50 for i in range(seqs)]
        q, k, v, md = _batch(lens, 9, 3, 64, layers=30, layer=7, num_blocks=seqs * 48 + 8, qlens=[n] * seqs)
        ref = best_ms(lambda: paged_attention_torch(q, k, v, md, 0.125), reps=5)
        ker = best_ms(lambda: paged_attention_torch(q, k, v, md, 0.125, decode_kernel=True))
        print(f"{seqs:3d} seqs x {n} query tokens, context ~700: reference {ref:8.3f} ms   "
              f"kernel {ker:7.3f} ms   ({ref / ker:.1f}x)  [{torch.get_num_threads()} threads]")


if __name__ == "__main__":
    assert cpu_attention.available()
    _timings()


# -- the fused ops of the CPU forward ------------------------------------------------------------------
def test_rms_norm_matches_torch_adds_the_residual_and_is_batch_invariant():
    g = torch.Generator().manual_seed(0)
    x, res, w = torch.randn(37, 576, generator=g), torch.randn(37, 576, generator=g), torch.randn(576, generator=g)
    want = torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
    torch.testing.assert_close(cpu_attention.rms_norm(x, w, 1e-5), want, atol=1e-5, rtol=1e-5)
    r = res.clone()
    got = cpu_attention.rms_norm(x, w, 1e-5, r)
    assert torch.equal(r, res + x)                                  # the stream, updated in place
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(res + x, (576,), w, 1e-5), atol=1e-5, rtol=1e-5)
    alone = torch.cat([cpu_attention.rms_norm(x[i:i + 1], w, 1e-5) for i in range(len(x))])
    assert torch.equal(alone, cpu_attention.rms_norm(x, w, 1e-5))   # a row's result does not depend on the batch


def test_rope_write_kv_equals_rotate_then_scatter():
    from engine.attention import write_kv
    from engine.model import apply_rope
    heads, kv_heads, d, t = 9, 3, 64, 5
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = torch.randn(t, 1, d // 2, generator=g), torch.randn(t, 1, d // 2, generator=g)
    slots = torch.tensor([3, 40, 17, 0, 63])
    caches = [torch.zeros(kv_cache_shape(4, kv_heads, 3, 16, d)) for _ in range(2)]
    views = [layer_views(c, 1) for c in caches]
    qk = apply_rope(qkv[:, :(heads + kv_heads) * d].view(t, -1, d), cos, sin)
    write_kv(*views[0], qk[:, heads:], qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d), slots)
    fused = qkv.clone()
    cpu_attention.rope_write_kv(fused, cos.view(t, -1), sin.view(t, -1), *views[1], slots, heads, kv_heads)
    torch.testing.assert_close(fused[:, :(heads + kv_heads) * d].view(t, -1, d), qk, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(caches[1], caches[0], atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_attention.rope_write_kv(qkv.clone(), cos.view(t, -1), sin.view(t, -1), *views[1],
                                    torch.tensor([0, 1, 2, 3, 64]), heads, kv_heads)


def test_a_built_kernel_loads_past_a_lock_left_by_a_killed_process():
    """A replica SIGKILLed while loading a kernel leaves torch cpp_extension's lock file in the build directory,
    and load() waits on that lock even when nothing needs building. A later process imports the built module
    directly instead of hanging (as every engine start on the machine would)."""
    import subprocess
    import sys

    from engine import cpu_model
    from engine.cpp_build import CFLAGS, build_key
    from engine.loader import cache_dir
    from tests.conftest import ROOT
    assert cpu_attention._load() is not None                          # built (and marked whole) by now
    key = build_key(cpu_model.NAME, cpu_model.SOURCE, CFLAGS + list(cpu_model.CFLAGS), cpu_model.INCLUDES)
    lock = cache_dir() / "torch_extensions" / f"torch{torch.__version__}-{key}" / "lock"
    lock.touch()
    try:
        res = subprocess.run([sys.executable, "-c", "from engine import cpu_attention\n"
                              "assert cpu_attention._load() is not None"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
    finally:
        lock.unlink(missing_ok=True)


def _naive(q, k_cache, v_cache, md, scale, window=0, softcap=0.0, sinks=None, chunk=0):
    """Attention written out token by token from the block tables: the query at position p weighs the keys at
    max(0, p - window + 1) .. p (all of 0 .. p without a window; from p - p % chunk with Llama 4's chunks), its scores
    capped as C * tanh(s / C), its head's sink logit one more score of the softmax, with no value (gpt-oss)."""
    bs, heads = k_cache.shape[1], k_cache.shape[2]
    group, out, t = q.shape[1] // heads, torch.empty_like(q), 0
    for i, (ctx, n) in enumerate(zip(md.seq_lens_list, md.query_lens_list)):
        slots = [(int(md.block_tables[i, p // bs]), p % bs) for p in range(ctx)]
        k = torch.stack([k_cache[b, o] for b, o in slots])             # [ctx, Hkv, D]
        v = torch.stack([v_cache[b, o] for b, o in slots])
        for p in range(ctx - n, ctx):
            lo = max(0, p - window + 1) if window else 0
            lo = max(lo, p - p % chunk) if chunk else lo
            for h in range(q.shape[1]):
                s = (k[lo:p + 1, h // group] @ q[t, h]) * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                if sinks is not None:
                    out[t, h] = torch.softmax(torch.cat([s, sinks[h:h + 1]]), 0)[:-1] @ v[lo:p + 1, h // group]
                    continue
                out[t, h] = torch.softmax(s, 0) @ v[lo:p + 1, h // group]
            t += 1
    return out


def _every_cpu_path_gives(want, q, k, v, md, **opts) -> None:
    """The torch reference, the kernel for its short queries, the one kernel for all and the decode entry point
    (sequences 0-2's single tokens) each give `want` under the layer's options (window, softcap, sinks, chunk)."""
    for name, got in [
        ("torch", paged_attention_torch(q, k, v, md, 0.125, **opts)),
        ("kernel for short queries", paged_attention_torch(q, k, v, md, 0.125, decode_kernel=True, **opts)),
        ("one kernel", cpu_attention.paged_attention_varlen(q, k, v, md.block_tables, md.seq_lens,
                                                            md.query_start_loc, 0.125, **opts))]:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda m: f"{name}: {m}")
    dec = [0, 1, 2]
    one = cpu_attention.paged_decode_attention(q[[0, 1, 5]], k, v, md.block_tables[dec], md.seq_lens[dec], 0.125,
                                               **opts)
    torch.testing.assert_close(one, want[[0, 1, 5]], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window,softcap", [(8, 0.0), (20, 0.0), (0, 5.0), (8, 5.0), (1, 0.0)])
def test_sliding_window_and_softcap(window, softcap):
    """A sliding window (Mistral, Gemma 2/3) and a score softcap (Gemma 2) in every CPU path, against attention
    written out token by token: decodes whose window starts mid-block or covers the whole context, a verify
    step, a prompt chunk (SDPA's path) and a fresh prompt. The window of 1 sees only the token itself. Scores are
    scaled up (x3) so that the cap bites."""
    q, k, v, md = _batch([5, 40, 61, 30, 45], 6, 2, 32, qlens=[1, 1, 4, 30, 20])
    q = q * 3
    want = _naive(q, k, v, md, 0.125, window, softcap)
    _every_cpu_path_gives(want, q, k, v, md, window=window, softcap=softcap)
    whole = _naive(q, k, v, md, 0.125)
    assert not torch.allclose(whole, want, atol=1e-3)                  # the options change what a test sees


@pytest.mark.parametrize("chunk,window", [(8, 0), (16, 0), (1, 0), (16, 6)])
def test_attention_chunks(chunk, window):
    """Llama 4's chunked attention in every CPU path against attention written out: a query sees only the keys of
    its chunk of positions (decodes at a chunk's first token and mid-chunk, a verify step across a boundary, a prompt
    chunk and a fresh prompt over several chunks); chunks of 1 see only the token itself; a window inside the chunk
    as well."""
    q, k, v, md = _batch([5, 40, 61, 30, 45], 6, 2, 32, qlens=[1, 1, 4, 30, 20])
    want = _naive(q, k, v, md, 0.125, window, chunk=chunk)
    _every_cpu_path_gives(want, q, k, v, md, window=window, chunk=chunk)
    assert not torch.allclose(_naive(q, k, v, md, 0.125, window), want, atol=1e-3)     # the chunks change it


@pytest.mark.parametrize("window", [0, 8])
def test_attention_sinks(window):
    """gpt-oss's sinks (a logit per query head, with no value) in every CPU path against attention written out,
    with and without its sliding window; the sinks are large enough to take much of each row's weight."""
    q, k, v, md = _batch([5, 40, 61, 30, 45], 6, 2, 32, qlens=[1, 1, 4, 30, 20])
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0, -3.0, 1.0])
    want = _naive(q, k, v, md, 0.125, window, sinks=sinks)
    _every_cpu_path_gives(want, q, k, v, md, window=window, sinks=sinks)
    assert not torch.allclose(_naive(q, k, v, md, 0.125, window), want, atol=1e-3)     # the sinks change it
    with pytest.raises(RuntimeError, match="sinks"):
        cpu_attention.paged_attention_varlen(q, k, v, md.block_tables, md.seq_lens, md.query_start_loc, 0.125,
                                             sinks=sinks[:4])
