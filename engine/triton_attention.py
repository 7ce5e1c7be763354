"""Triton paged attention for a mixed batch (decodes, prefills, prefill chunks) in one launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# tl.dot needs every dimension >= 16 on NVIDIA GPUs.
_MIN_DOT = 16
_MAX_BLOCK_M = 64     # query rows (tokens x heads of one KV group) per program


@triton.jit
def _find_seq(qsl_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence owning global query block `q_block_idx`: seq i's blocks start at qsl[i] // BLOCK_Q + i."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, ks_ptr, vs_ptr, sinks_ptr,
    scale_log2, num_seqs, num_heads, n_rows, window, softcap, chunk,
    s_qt, s_qh, s_qd,
    s_ot, s_oh, s_od,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_bt0, s_bt1,
    s_ksb, s_kss, s_ksh, s_vsb, s_vss, s_vsh,
    QUANT: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, DOT_PREC: tl.constexpr, NUM_SPLITS: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, CHUNK: tl.constexpr,
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(qsl_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_block_local = q_block_idx - (q_start // BLOCK_Q + seq)
    # The grid is an upper bound on the number of query blocks: spare programs leave here.
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len                      # cached tokens before the new ones

    # Row r of the tile is query token r // GROUP_P, head r % GROUP_P of this KV head's group,
    # so each K/V tile is loaded once for the whole group (GQA).
    rows = tl.arange(0, BLOCK_M)
    q_local = q_block_local * BLOCK_Q + rows // GROUP_P
    head_in_group = rows % GROUP_P
    head = kv_head * GROUP + head_in_group
    row_ok = (q_local < q_len) & (head_in_group < GROUP)
    q_pos = ctx_len + q_local                      # absolute position: causal limit of the row
    tok = (q_start + q_local).to(tl.int64)

    d = tl.arange(0, HEAD_P)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + d[None, :] * s_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)

    # Keys past the last query of this tile are masked for every row: skip them.
    kv_end = tl.minimum(seq_len, ctx_len + (q_block_local + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    # A sliding window: keys before the first query's window are masked for every row: skip those too.
    tile_lo = 0
    if WINDOW:
        tile_lo = tl.maximum(ctx_len + q_block_local * BLOCK_Q - window + 1, 0) // TILE_N
    # An attention chunk: keys before the first query's chunk likewise.
    if CHUNK:
        first_q = ctx_len + q_block_local * BLOCK_Q
        tile_lo = tl.maximum(tile_lo, (first_q - first_q % chunk) // TILE_N)
    n = tl.arange(0, TILE_N)
    bt_row = bt_ptr + seq.to(tl.int64) * s_bt0
    k_head = k_ptr + kv_head * s_kh
    v_head = v_ptr + kv_head * s_vh

    # Split-KV (flash-decoding): with NUM_SPLITS > 1 this program takes one slice of the key tiles and
    # leaves its unnormalised partial (m, l, acc) for _combine_splits.
    per_split = tl.cdiv(num_tiles - tile_lo, NUM_SPLITS)
    t_first = tile_lo + split * per_split
    t_last = tl.minimum(num_tiles, t_first + per_split)
    for t in range(t_first, t_last):
        k_pos = t * TILE_N + n
        k_ok = k_pos < kv_end
        # A tile may span several pages, so look up the page of every key; int64 because
        # block * block stride overflows int32 on large caches.
        blk = tl.load(bt_row + (k_pos // BLOCK_SIZE) * s_bt1, mask=k_ok, other=0).to(tl.int64)
        off = k_pos % BLOCK_SIZE
        k = tl.load(k_head + blk[None, :] * s_kb + off[None, :] * s_ks + d[:, None] * s_kd,
                    mask=k_ok[None, :] & d_ok[:, None], other=0.0)           # [HEAD_P, TILE_N]
        v = tl.load(v_head + blk[:, None] * s_vb + off[:, None] * s_vs + d[None, :] * s_vd,
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)           # [TILE_N, HEAD_P]
        if QUANT:      # int8 / fp8 codes times their token's scale (engine/kv_layout.py)
            ksc = tl.load(ks_ptr + kv_head * s_ksh + blk * s_ksb + off * s_kss, mask=k_ok, other=0.0)
            vsc = tl.load(vs_ptr + kv_head * s_vsh + blk * s_vsb + off * s_vss, mask=k_ok, other=0.0)
            k = (k.to(tl.float32) * ksc[None, :]).to(q.dtype)
            v = (v.to(tl.float32) * vsc[:, None]).to(q.dtype)

        s = tl.dot(q, k, input_precision=DOT_PREC) * scale_log2             # log2 domain for exp2
        if SOFTCAP:    # softcap * tanh(s / softcap) on the natural-log scores, back in log2 (tanh from exp)
            c = softcap * 1.4426950408889634
            s = c * (1.0 - 2.0 / (tl.exp(2.0 * s / c) + 1.0))
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        if CHUNK:
            visible = visible & (k_pos[None, :] >= q_pos[:, None] - q_pos[:, None] % chunk)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if NUM_SPLITS > 1:
        prow = split * n_rows + tok * num_heads + head
        tl.store(part_m_ptr + prow, m_i, mask=row_ok)
        tl.store(part_l_ptr + prow, l_i, mask=row_ok)
        tl.store(part_acc_ptr + prow[:, None] * HEAD_P + d[None, :], acc, mask=row_ok[:, None])
    else:
        if SINKS:      # the head's sink logit joins the softmax: one more term of the sum, with no value
            sk = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")) * 1.4426950408889634
            m_f = tl.maximum(m_i, sk)
            m_fs = tl.where(m_f > float("-inf"), m_f, 0.0)
            alpha = tl.math.exp2(m_i - m_fs)
            l_i = l_i * alpha + tl.math.exp2(sk - m_fs)
            acc = acc * alpha[:, None]
        # Padding rows saw no key (l = 0); they are not stored, but avoid 0/0 anyway.
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + d[None, :] * s_od,
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_splits(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, num_heads, n_rows, s_ot, s_oh, s_od,
                    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr, SINKS: tl.constexpr):
    """One (token, head) row: the splits' partials rescaled to their common max (the head's sink among them) and
    normalised once."""
    row = tl.program_id(0)
    tok, head = row // num_heads, row % num_heads
    sp = tl.arange(0, NUM_SPLITS)
    m = tl.load(part_m_ptr + sp * n_rows + row)
    l = tl.load(part_l_ptr + sp * n_rows + row)
    m_max = tl.max(m, 0)
    if SINKS:
        sk = tl.load(sinks_ptr + head) * 1.4426950408889634
        m_max = tl.maximum(m_max, sk)
    m_safe = tl.where(m_max > float("-inf"), m_max, 0.0)
    w = tl.math.exp2(m - m_safe)                                         # a split with no key: -inf -> 0
    d = tl.arange(0, HEAD_P)
    acc = tl.load(part_acc_ptr + (sp[:, None] * n_rows + row) * HEAD_P + d[None, :])
    total = tl.sum(l * w, 0)
    if SINKS:
        total += tl.math.exp2(sk - m_safe)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + tok * s_ot + head * s_oh + d * s_od, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def num_kv_splits(num_programs: int, max_query_len: int, device: torch.device) -> int:
    """How many slices of the keys each program's work is split into (flash-decoding). Decode and verify
    batches launch one program per (sequence, KV head): at batch 1 that is a handful of programs on a GPU of
    a hundred SMs, each walking the whole context (measured on an H200: 30 us a layer for 8 programs, most
    SMs idle). Split until there are about two programs per SM, at most 16 slices. Prefills have programs
    enough. A shape-only rule (the SM count is a host constant): CUDA-graph safe."""
    if device.type != "cuda" or max_query_len > 8:
        return 1
    sms = _sm_count(device)
    splits = 1
    while splits < 16 and num_programs * splits < 2 * sms:
        splits *= 2
    return splits


_SMS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def triton_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           max_query_len: int, scale: float, num_splits: int | None = None,
                           k_scale=None, v_scale=None, window: int = 0, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """Attention of q [T, H, D] over the paged cache; same contract as `paged_attention_torch`.
    `num_splits`: key slices per program (None: num_kv_splits decides; the tests set it). A quantized cache
    (int8 or fp8 codes) comes with its scales [blocks, block_size, kv_heads] (k_scale, v_scale). window, softcap:
    a sliding window and a score softcap (engine/attention.py; 0: none), constants of a layer; sinks [H] fp32: each
    head's sink logit (gpt-oss; None: none); chunk: Llama 4's attention chunk (0: none).

    CUDA-graph safe: the grid and constexprs follow from shapes (tokens, sequences) and the host int
    max_query_len (the query width of a captured decode/verify step); nothing reads device memory
    on the host, and the output's shape is fixed by q's."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_dim = k_cache.shape
    assert v_cache.shape == k_cache.shape and kv_dim == head_dim, "cache shape mismatch"
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    num_seqs = seq_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if sinks is not None:
        sinks = sinks.float().contiguous()
        assert sinks.shape == (num_heads,), "sinks: one per query head"
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    head_p = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    # Size the query tile from the longest query (a host int, no sync): decode-only batches get
    # the smallest tile, prefills up to _MAX_BLOCK_M rows. Only speed depends on it, not results.
    block_m = min(max(_MIN_DOT, group_p * triton.next_power_of_2(max(1, max_query_len))),
                  max(_MAX_BLOCK_M, group_p))
    block_q = block_m // group_p
    tile_n = 32 if block_m >= 64 else _MIN_DOT
    # Upper bound of sum_i ceil(qlen_i / block_q) (see _find_seq); spare programs exit early.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    # 64 x 128 fp32 accumulator plus per-key K/V addresses spill at 4 warps (ptxas, sm_90).
    num_warps = 8 if block_m * head_p >= 64 * 128 else 4
    # fp32 caches are the test path: keep dots exact instead of TF32 (None: backend default).
    dot_prec = "ieee" if q.dtype == torch.float32 else None
    quant = k_scale is not None
    assert quant == (k_cache.dtype in (torch.int8, torch.float8_e4m3fn)), "a quantized cache comes with scales"
    ks, vs = (k_scale, v_scale) if quant else (out, out)                   # not read unless quantized
    scale_strides = (*k_scale.stride(), *v_scale.stride()) if quant else (0,) * 6

    splits = num_splits or num_kv_splits(grid[0] * grid[1], max_query_len, q.device)
    assert splits & (splits - 1) == 0, "num_splits must be a power of two"
    n_rows = num_tokens * num_heads
    if splits > 1:
        part_m = torch.empty((splits, n_rows), dtype=torch.float32, device=q.device)
        part_l = torch.empty((splits, n_rows), dtype=torch.float32, device=q.device)
        part_acc = torch.empty((splits, n_rows, head_p), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out                  # not read
    _paged_attention_kernel[grid + (splits,)](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        part_m, part_l, part_acc, ks, vs, sinks if sinks is not None else out,
        float(scale) * 1.4426950408889634, num_seqs, num_heads, n_rows, int(window), float(softcap), int(chunk),
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *scale_strides, QUANT=quant, GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, HEAD_P=head_p,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n,
        DOT_PREC=dot_prec, NUM_SPLITS=splits, WINDOW=bool(window), SOFTCAP=bool(softcap), SINKS=sinks is not None,
        CHUNK=bool(chunk), num_warps=num_warps,
    )
    if splits > 1:
        _combine_splits[(n_rows,)](out, part_m, part_l, part_acc, sinks if sinks is not None else out, num_heads,
                                   n_rows, *out.stride(), NUM_SPLITS=splits, HEAD_DIM=head_dim, HEAD_P=head_p,
                                   SINKS=sinks is not None)
    return out
