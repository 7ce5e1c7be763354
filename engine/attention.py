"""Paged attention over a mixed batch (decodes, fresh prefills, prefill chunks on a cached prefix).

Contract shared by the torch reference (CPU) and the Triton kernel (CUDA), vLLM-style:
  q               [num_tokens, num_heads, head_dim]   the batch's new tokens, sequence after sequence
  k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]  (strided views of the KV tensor)
  block_tables    [num_seqs, max_blocks] int32         physical block of each logical block
  seq_lens        [num_seqs] int32                     context length, new tokens included
  query_start_loc [num_seqs + 1] int32                 sequence i owns q[qsl[i]:qsl[i+1]], the last
                                                       tokens of its context (causal within them)
The new tokens' K/V are written to the cache (write_kv) before attention reads it.

Two per-layer options (Mistral, Gemma 2/3, Qwen2 with use_sliding_window): `window` W > 0, a sliding window: the
query at position p sees the keys at positions p - W + 1 .. p (transformers' `kv_idx > q_idx - W`); `softcap` C > 0
(Gemma 2): each scaled score s becomes C * tanh(s / C) before the softmax. 0 turns either off. And `sinks`
[num_heads] (gpt-oss), a learned logit per query head that joins each row's softmax as one more score with no value:
the row's weights sum to less than 1 (transformers' `s_aux`). None: none. And `chunk` C > 0 (Llama 4's chunked
attention layers): positions fall in chunks of C, and the query at p sees only its own chunk's keys, p - p % C .. p
(transformers' chunked causal mask).

A quantized cache (kv_cache_dtype int8 / fp8, engine/kv_layout.py) adds k_scale/v_scale [num_blocks, block_size,
num_kv_heads] (fp32, strided views too): write_kv stores codes and scales, and every reader turns a row back into
floats as it reads it. A prompt's own new tokens attend to each other unquantized (k_new/v_new), as vLLM's do.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.block_pool import blocks_for
from engine.kv_layout import quantize_kv


# Queries of at most this many tokens (decodes, speculative verify steps of k+1 tokens, short
# prompts) go to the C++ CPU kernel; longer ones (prefill chunks) to SDPA.
SHORT_QUERY = 16


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor          # [num_seqs] int32
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    seq_lens_list: list[int]        # host copies, so the torch path never syncs; the CUDA path never
    query_lens_list: list[int]      # reads them (a replayed CUDA graph would see the captured ones)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store the new tokens' K/V [num_tokens, kv_heads, head_dim] at their cache slots (quantized, with a scale per
    token and head, where the cache has scales). v None: a latent cache's (engine/kv_layout.py), K alone."""
    bs, heads, d = k_cache.shape[1:]
    if v is not None and v_cache.stride() != k_cache.stride():
        raise ValueError("the K and V caches must have the same strides")
    idx = None
    for cache, x, sc in ((k_cache, k, k_scale),) + (() if v is None else ((v_cache, v, v_scale),)):
        rows, base, block_stride, head_stride = _row_view(_bytes(cache), d)
        if idx is None:                   # each (token, head)'s row, relative to base: one index for K and V
            slot_stride = cache.stride(1) // d                             # whole rows in any layout
            tok = (slot_mapping // bs) * block_stride + (slot_mapping % bs) * slot_stride
            idx = (tok.unsqueeze(1) + _head_offsets(heads, head_stride, tok.device)).flatten()
        if sc is not None:
            x, scale = quantize_kv(x, _KV_DTYPE_NAMES[cache.dtype])
            _scale_rows(sc).index_copy_(0, _scale_index(sc, slot_mapping), scale.flatten())
        rows.index_copy_(0, idx + base, _bytes(x.reshape(idx.shape[0], d).to(cache.dtype)))


_KV_DTYPE_NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their bytes (CPU index ops do not take fp8); anything else as it is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _scale_rows(scale: torch.Tensor) -> torch.Tensor:
    """A flat view of the storage under a scale view [blocks, block_size, kv_heads] (fp32)."""
    return scale.as_strided((scale.untyped_storage().nbytes() // 4,), (1,), 0)


def _scale_index(scale: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """[num_tokens * kv_heads] flat indices (into _scale_rows) of each token's heads' scales."""
    bs, heads = scale.shape[1:]
    s0, s1, s2 = scale.stride()
    tok = scale.storage_offset() + (slot_mapping // bs) * s0 + (slot_mapping % bs) * s1
    return (tok.unsqueeze(1) + _head_offsets(heads, s2, tok.device)).flatten()


@functools.cache
def _head_offsets(heads: int, head_stride: int, device: torch.device) -> torch.Tensor:
    """[heads] row offsets of a token's heads (cached: it is asked on every layer of every step)."""
    return torch.arange(heads, device=device) * head_stride


def _row_view(cache: torch.Tensor, row: int) -> tuple[torch.Tensor, int, int, int]:
    """A 2-D view of the cache's whole storage in rows of `row` elements (a layer view
    [blocks, block_size, kv_heads, head_dim] whose block and head strides are whole rows).

    Row copies (index_copy_/index_select) are ~100x faster on CPU than advanced indexing into
    the strided per-layer view. Returns (rows, row of block 0 slot 0 head 0, rows between
    blocks, rows between heads).
    """
    offset, block_stride, head_stride = cache.storage_offset(), cache.stride(0), cache.stride(2)
    if cache.stride(3) != 1 or offset % row or block_stride % row or head_stride % row:
        raise ValueError(f"KV cache strides {cache.stride()} are not whole rows of {row}")
    n_rows = cache.untyped_storage().nbytes() // cache.element_size() // row
    rows = cache.as_strided((n_rows, row), (row, 1), 0)
    return rows, offset // row, block_stride // row, head_stride // row


def paged_attention(q, k_cache, v_cache, md: AttentionMetadata, scale: float,
                    k_new=None, v_new=None, one_kernel: bool = False, k_scale=None, v_scale=None,
                    window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    chunk: int = 0) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the torch reference elsewhere. `one_kernel` (CPU): every query, long
    prefill chunks too, goes to the C++ kernel, whose rows do not depend on how a prompt was chunked or how
    much of it was cached. Models with quantized activations need that to stay equal to themselves: there a
    last-bit difference between SDPA and the kernel can move an int8 code, and the greedy path with it.
    k_scale/v_scale: a quantized cache's scales; window, softcap, sinks, chunk: the layer's (module docstring)."""
    if q.is_cuda:
        from engine.triton_attention import triton_paged_attention
        return triton_paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens,
                                      md.query_start_loc, md.max_query_len, scale, k_scale=k_scale, v_scale=v_scale,
                                      window=window, softcap=softcap, sinks=sinks, chunk=chunk)
    from engine import cpu_attention
    kernel = q.dtype == torch.float32 and (k_cache.dtype == torch.float32 or k_scale is not None) \
        and cpu_attention.available()
    if kernel and one_kernel:
        return cpu_attention.paged_attention_varlen(q, k_cache, v_cache, md.block_tables, md.seq_lens,
                                                    md.query_start_loc, scale, k_scale, v_scale, window, softcap, sinks,
                                                    chunk)
    return paged_attention_torch(q, k_cache, v_cache, md, scale, k_new, v_new, decode_kernel=kernel,
                                 k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap, sinks=sinks,
                                 chunk=chunk)


def paged_attention_torch(q, k_cache, v_cache, md: AttentionMetadata, scale: float,
                          k_new=None, v_new=None, decode_kernel: bool = False,
                          k_scale=None, v_scale=None, window: int = 0, softcap: float = 0.0,
                          sinks: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """Reference: single-token queries batched in one SDPA call, longer queries one by one.

    `k_new`/`v_new` (the batch's fresh K/V) let a prefill with no cached context skip the gather;
    `decode_kernel` sends every query of at most SHORT_QUERY tokens (decodes, speculative verify
    steps, short prompts) to the C++ kernel (engine/cpu_attention.py) in one call, and leaves only
    the longer ones (prefill chunks) to SDPA.
    """
    qsl = [0]
    for n in md.query_lens_list:
        qsl.append(qsl[-1] + n)
    scales, opts = (k_scale, v_scale), (window, softcap, sinks, chunk)
    if decode_kernel:
        from engine.cpu_attention import paged_attention_varlen
        short = [i for i, n in enumerate(md.query_lens_list) if n <= SHORT_QUERY]
        if len(short) == md.num_seqs:                     # decode / verify steps: no copy, no scatter
            return paged_attention_varlen(q, k_cache, v_cache, md.block_tables, md.seq_lens,
                                          md.query_start_loc, scale, *scales, *opts)
        out = torch.empty_like(q)
        if short:
            rows = torch.tensor([t for i in short for t in range(qsl[i], qsl[i + 1])])
            sub_qsl = [0]
            for i in short:
                sub_qsl.append(sub_qsl[-1] + md.query_lens_list[i])
            sel = torch.tensor(short)
            o = paged_attention_varlen(q.index_select(0, rows), k_cache, v_cache,
                                       md.block_tables.index_select(0, sel), md.seq_lens.index_select(0, sel),
                                       torch.tensor(sub_qsl, dtype=torch.int32), scale, *scales, *opts)
            out.index_copy_(0, rows, o)
        rest = [i for i, n in enumerate(md.query_lens_list) if n > SHORT_QUERY]
    else:
        decodes = [i for i, n in enumerate(md.query_lens_list) if n == 1]
        if len(decodes) == md.num_seqs:                   # the common all-decode step: no scatter
            return _decode_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, scale, *scales, *opts)
        out = torch.empty_like(q)
        if decodes:
            rows = torch.tensor([qsl[i] for i in decodes])
            out[rows] = _decode_attention(q[rows], k_cache, v_cache, md.block_tables[decodes],
                                          md.seq_lens[decodes], scale, *scales, *opts)
        rest = [i for i, n in enumerate(md.query_lens_list) if n != 1]
    for i in rest:
        n, ctx, s, e = md.query_lens_list[i], md.seq_lens_list[i], qsl[i], qsl[i + 1]
        if ctx == n and k_new is not None:
            k, v = k_new[s:e].transpose(0, 1), v_new[s:e].transpose(0, 1)
        else:
            bt = md.block_tables[i:i + 1]
            k = _gather(k_cache, bt, ctx, k_scale, q.dtype)[0]
            v = _gather(v_cache, bt, ctx, v_scale, q.dtype)[0]
        out[s:e] = _prefill_attention(q[s:e], k, v, scale, *opts)
    return out


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, n_tokens: int, scale: torch.Tensor | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first n_tokens of K (or V) of each sequence, heads first: [num_seqs, kv_heads, n_tokens, D]; a quantized
    cache's rows times their scales, in `dtype`.

    A block's tokens of one head and layer are contiguous (engine/kv_layout.py), so each
    (block, head) is one row of block_size x D (and one of block_size scales)."""
    bs, heads, d = cache.shape[1:]
    if cache.stride(1) != d:
        raise ValueError(f"KV cache strides {cache.stride()}: a block's tokens of a head must be contiguous")
    rows, base, block_stride, head_stride = _row_view(_bytes(cache), bs * d)
    nb = blocks_for(n_tokens, bs)
    blocks = block_tables[:, :nb].long().unsqueeze(1) * block_stride          # [S, 1, nb]
    idx = base + blocks + (torch.arange(heads) * head_stride).unsqueeze(-1)  # [S, heads, nb]
    out = rows.index_select(0, idx.flatten()).view(cache.dtype).view(block_tables.shape[0], heads, nb * bs, d)
    if scale is not None:
        s0, s1, s2 = scale.stride()
        if s1 != 1:
            raise ValueError(f"KV scale strides {scale.stride()}: a block's scales of a head must be contiguous")
        sidx = scale.storage_offset() + block_tables[:, :nb].long().unsqueeze(1) * s0 \
            + (torch.arange(heads) * s2).unsqueeze(-1)                          # [S, heads, nb]: rows of bs
        flat = _scale_rows(scale)
        sc = flat.as_strided((flat.numel() - bs + 1, bs), (1, 1)).index_select(0, sidx.flatten())
        out = (out.float() * sc.view(block_tables.shape[0], heads, nb * bs, 1)).to(dtype or torch.float32)
    return out[:, :, :n_tokens]


def _prefill_attention(q, k, v, scale, window: int = 0, softcap: float = 0.0, sinks=None, chunk: int = 0):
    """q [n, H, D] are the last n positions of a context k/v [Hkv, ctx, D]."""
    n, ctx = q.shape[0], k.shape[1]
    qh, kh, vh = q.transpose(0, 1)[None], k[None], v[None]
    if n == ctx and not window and not softcap and sinks is None and not chunk:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        pos_q = torch.arange(ctx - n, ctx).unsqueeze(1)
        keys = torch.arange(ctx).unsqueeze(0)
        mask = keys <= pos_q                                           # [n, ctx]
        if window:
            mask &= keys > pos_q - window
        if chunk:
            mask &= keys >= pos_q - pos_q % chunk
        o = _attention(qh, kh, vh, mask, scale, softcap, sinks)
    return o[0].transpose(0, 1)


def _decode_attention(q, k_cache, v_cache, block_tables, seq_lens: torch.Tensor, scale, k_scale=None, v_scale=None,
                      window: int = 0, softcap: float = 0.0, sinks=None, chunk: int = 0):
    """q [B, H, D], one new token per sequence; keys padded to the longest context."""
    lens = seq_lens.tolist()
    max_len = max(lens)
    k = _gather(k_cache, block_tables, max_len, k_scale, q.dtype)                # [B, Hkv, max_len, D]
    v = _gather(v_cache, block_tables, max_len, v_scale, q.dtype)
    keys, ends = torch.arange(max_len).unsqueeze(0), seq_lens.unsqueeze(1)
    mask = keys < ends
    if window:
        mask &= keys >= ends - window
    if chunk:
        mask &= keys >= (ends - 1) - (ends - 1) % chunk
    o = _attention(q.unsqueeze(2), k, v, mask[:, None, None, :], scale, softcap, sinks)
    return o.squeeze(2)


def _attention(q, k, v, mask, scale: float, softcap: float = 0.0, sinks=None):
    """SDPA of q [B, H, n, D] over k/v [B, Hkv, ctx, D] under a boolean mask; with a softcap or sinks, the same
    written out (SDPA has no place for either): scores scaled, capped (C * tanh(s / C)), masked, softmaxed with each
    head's sink as one more column, which is then dropped."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:
        sink = sinks.float().view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p, v.float()).to(q.dtype)
