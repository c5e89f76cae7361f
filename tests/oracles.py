"""Float64 NumPy ground-truth oracles for hyscale_jax.

Plain NumPy, no JAX. Everything is computed in float64 with explicit loops
where that keeps the definition obvious; inputs in tests are tiny.

Letters: B batch, Tq/T query length, Tk/S key length, H heads, D head dim,
G kv groups (query head h uses group h // (H // G)), K number of selected
indices per query.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "index_scores",
    "visibility",
    "topk_oracle",
    "sparse_attention_oracle",
    "sparse_attention_grads_oracle",
    "indexer_loss_oracle",
    "indexer_loss_grads_oracle",
    "grouped_matmul_oracle",
    "gated_delta_rule_oracle",
    "gated_deltanet_oracle",
]


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _group_of(h: int, H: int, G: int) -> int:
    if H % G != 0:
        raise ValueError(f"H={H} is not divisible by G={G}")
    return h // (H // G)


# ---------------------------------------------------------------------------
# 1. Indexer score and visibility
# ---------------------------------------------------------------------------


def index_scores(q, k, weights, scale) -> np.ndarray:
    """Lightning-indexer scores.

    Args:
      q: [B, Tq, H, D] index queries.
      k: [B, Tk, D] index keys (shared by all heads).
      weights: [B, Tq, H] per-head weights, or None (= all ones).
      scale: python float.

    Returns:
      f64[B, Tq, Tk] with
      score[b,t,s] = scale * sum_h weights[b,t,h] * relu(<q[b,t,h,:], k[b,s,:]>).
    """
    q = _f64(q)
    k = _f64(k)
    B, Tq, H, _ = q.shape
    if weights is None:
        w = np.ones((B, Tq, H), dtype=np.float64)
    else:
        w = _f64(weights)
    dots = np.einsum("bthd,bsd->bths", q, k)  # [B, Tq, H, Tk]
    relu = np.maximum(dots, 0.0)
    return float(scale) * np.einsum("bth,bths->bts", w, relu)


def visibility(B, Tq, Tk, *, compress_ratio=1, q_offset=0, segment_ids=None) -> np.ndarray:
    """Causal (compressed) visibility mask.

    Query t sits at absolute position p = q_offset + t. Key s (a compressed
    block of `compress_ratio` tokens) is visible iff
    (s + 1) * compress_ratio <= p + 1. If segment_ids = (q_seg [B,Tq],
    kv_seg [B,Tk]) is given, additionally q_seg[b,t] == kv_seg[b,s].

    Returns:
      bool[B, Tq, Tk].
    """
    p = q_offset + np.arange(Tq)[:, None]  # [Tq, 1]
    s = np.arange(Tk)[None, :]  # [1, Tk]
    causal = (s + 1) * compress_ratio <= p + 1  # [Tq, Tk]
    vis = np.broadcast_to(causal[None], (B, Tq, Tk)).copy()
    if segment_ids is not None:
        q_seg, kv_seg = segment_ids
        q_seg = np.asarray(q_seg)
        kv_seg = np.asarray(kv_seg)
        vis &= q_seg[:, :, None] == kv_seg[:, None, :]
    return vis


# ---------------------------------------------------------------------------
# 2. Exact top-k
# ---------------------------------------------------------------------------


def topk_oracle(
    q,
    k,
    weights=None,
    *,
    topk,
    compress_ratio=1,
    q_offset=0,
    segment_ids=None,
    scale=1.0,
):
    """Exact top-k over visible keys of the indexer score.

    Args:
      q: [B, Tq, H, D]; k: [B, Tk, D]; weights: [B, Tq, H] or None.
      topk: number of slots K.
      compress_ratio, q_offset, segment_ids: see `visibility`.
      scale: indexer score scale.

    Returns:
      indices: int32[B, Tq, topk]; scores: f64[B, Tq, topk].
      Entries are the `topk` greatest visible keys under the total order
      "score descending, then index ascending", in that order. Slots beyond
      the number of visible keys hold index -1 and score -inf. (-0.0 and +0.0
      compare equal, so they tie and the lower index wins.)
    """
    scores = index_scores(q, k, weights, scale)
    B, Tq, Tk = scores.shape
    vis = visibility(B, Tq, Tk, compress_ratio=compress_ratio, q_offset=q_offset,
                     segment_ids=segment_ids)
    out_idx = np.full((B, Tq, topk), -1, dtype=np.int32)
    out_sc = np.full((B, Tq, topk), -np.inf, dtype=np.float64)
    for b in range(B):
        for t in range(Tq):
            cand = [(-float(scores[b, t, s]), s) for s in range(Tk) if vis[b, t, s]]
            cand.sort()  # -score ascending (score descending), then index ascending
            for j, (neg, s) in enumerate(cand[:topk]):
                out_idx[b, t, j] = s
                out_sc[b, t, j] = scores[b, t, s]
    return out_idx, out_sc


# ---------------------------------------------------------------------------
# 3. Sparse attention forward and gradients
# ---------------------------------------------------------------------------


def _row_softmax(logits, sink):
    """Softmax pieces for one (b,t,h) row.

    logits: f64[n] (n may be 0); sink: float or None.
    Returns (p f64[n], p_sink float, lse float).
    """
    parts = list(logits) + ([sink] if sink is not None else [])
    if not parts:
        return np.zeros((0,), np.float64), 0.0, -math.inf
    m = max(parts)
    denom = sum(math.exp(x - m) for x in parts)
    lse = m + math.log(denom)
    p = np.array([math.exp(x - lse) for x in logits], dtype=np.float64)
    p_sink = math.exp(sink - lse) if sink is not None else 0.0
    return p, p_sink, lse


def sparse_attention_oracle(q, k, v, indices, *, scale, sinks=None):
    """Sparse (index-gathered) GQA attention forward.

    Args:
      q: [B, T, H, Dk]; k: [B, S, G, Dk]; v: [B, S, G, Dv].
      indices: int [B, T, K] into S, shared by all groups. Entry valid iff
        0 <= idx < S; duplicates count once per occurrence.
      scale: logit scale.
      sinks: [H] or None; adds exp(sinks[h]) to the softmax denominator.

    Returns:
      out: f64[B, T, H, Dv]; lse: f64[B, T, H].
      A row with no valid index gives out = 0 and lse = -inf (or sinks[h]).
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    indices = np.asarray(indices)
    B, T, H, _ = q.shape
    S, G, Dv = k.shape[1], k.shape[2], v.shape[3]
    sk = None if sinks is None else _f64(sinks)
    out = np.zeros((B, T, H, Dv), np.float64)
    lse = np.zeros((B, T, H), np.float64)
    for b in range(B):
        for t in range(T):
            idx = [int(i) for i in indices[b, t] if 0 <= int(i) < S]
            for h in range(H):
                g = _group_of(h, H, G)
                logits = [scale * float(q[b, t, h] @ k[b, s, g]) for s in idx]
                p, _, l = _row_softmax(logits, None if sk is None else float(sk[h]))
                lse[b, t, h] = l
                for j, s in enumerate(idx):
                    out[b, t, h] += p[j] * v[b, s, g]
    return out, lse


def sparse_attention_grads_oracle(q, k, v, indices, dout, dlse=None, *, scale, sinks=None):
    """Exact gradients of L = sum(out * dout) + sum(lse * dlse).

    Args:
      q, k, v, indices, scale, sinks: as in `sparse_attention_oracle`.
      dout: [B, T, H, Dv]; dlse: [B, T, H] or None (= zeros).

    Returns:
      dq f64[B,T,H,Dk], dk f64[B,S,G,Dk], dv f64[B,S,G,Dv],
      dsinks f64[H] (None when sinks is None).
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    dout = _f64(dout)
    indices = np.asarray(indices)
    B, T, H, _ = q.shape
    S, G = k.shape[1], k.shape[2]
    dl = np.zeros((B, T, H)) if dlse is None else _f64(dlse)
    sk = None if sinks is None else _f64(sinks)
    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    dsinks = None if sk is None else np.zeros(H, np.float64)
    for b in range(B):
        for t in range(T):
            idx = [int(i) for i in indices[b, t] if 0 <= int(i) < S]
            for h in range(H):
                g = _group_of(h, H, G)
                logits = [scale * float(q[b, t, h] @ k[b, s, g]) for s in idx]
                p, p_sink, _ = _row_softmax(logits, None if sk is None else float(sk[h]))
                out = np.zeros(v.shape[3])
                for j, s in enumerate(idx):
                    out += p[j] * v[b, s, g]
                D = float(dout[b, t, h] @ out)
                for j, s in enumerate(idx):
                    dp = float(dout[b, t, h] @ v[b, s, g])
                    ds = p[j] * (dp - D + dl[b, t, h])
                    dq[b, t, h] += scale * ds * k[b, s, g]
                    dk[b, s, g] += scale * ds * q[b, t, h]
                    dv[b, s, g] += p[j] * dout[b, t, h]
                if dsinks is not None:
                    dsinks[h] += p_sink * (dl[b, t, h] - D)
    return dq, dk, dv, dsinks


# ---------------------------------------------------------------------------
# 4. Indexer KL loss (DSA distillation)
# ---------------------------------------------------------------------------


def _indexer_rows(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices,
                  index_scale, attn_scale, compress_ratio, q_offset, segment_ids,
                  key_tokens=None, key_pool="sum"):
    """Per-row pieces of the indexer KL loss.

    Returns (rows, I) where I is f64[B,T,S] indexer logits and rows is a list
    of dicts for *valid* rows: {b, t, support (list of key ids, one per slot),
    p (teacher, f64[n]), qs (student softmax, f64[n]), loss (float)}.
    """
    index_q = _f64(index_q)
    index_k = _f64(index_k)
    attn_q = _f64(attn_q)
    attn_k = _f64(attn_k)
    I = index_scores(index_q, index_k, index_weights, index_scale)  # [B,T,S]
    B, T, S = I.shape
    H = attn_q.shape[2]
    G = attn_k.shape[2]
    if indices is None:
        vis = visibility(B, T, S, compress_ratio=compress_ratio, q_offset=q_offset,
                         segment_ids=segment_ids)
    elif attn_lse is None:
        raise ValueError("attn_lse=None is only supported in the dense form (indices=None)")
    rows = []
    for b in range(B):
        for t in range(T):
            if indices is None:
                support = [s for s in range(S) if vis[b, t, s]]
            else:
                slots = [j for j, i in enumerate(np.asarray(indices)[b, t]) if 0 <= int(i) < S]
                support = [int(np.asarray(indices)[b, t, j]) for j in slots]
            if not support:
                continue
            # the attention keys behind each support entry: itself, or its block's listed tokens
            if key_tokens is None:
                keys_of = [[s] for s in support]
            else:
                S_attn = attn_k.shape[1]
                keys_of = [[int(u) for u in np.asarray(key_tokens)[b, t, j] if 0 <= int(u) < S_attn]
                           for j in slots]
            flat = [u for keys in keys_of for u in keys]
            # attention logits over the attention keys: [H, n_keys]
            al = np.array([[attn_scale * float(attn_q[b, t, h] @ attn_k[b, s, _group_of(h, H, G)])
                            for s in flat] for h in range(H)], dtype=np.float64).reshape(H, len(flat))
            if attn_lse is None:
                m = al.max(axis=1, keepdims=True)
                lse_h = (m + np.log(np.exp(al - m).sum(axis=1, keepdims=True)))[:, 0]
            else:
                lse_h = _f64(attn_lse)[b, t]
            per_key = np.exp(al - lse_h[:, None]).sum(axis=0)  # [n_keys]
            pool = np.max if key_pool == "max" else np.sum
            u, start = [], 0
            for keys in keys_of:
                part = per_key[start:start + len(keys)]
                u.append(float(pool(part)) if len(part) else 0.0)
                start += len(keys)
            u = np.array(u, dtype=np.float64)  # [n]
            usum = float(u.sum())
            if not usum > 0.0:
                continue
            p = u / usum
            il = I[b, t, support]
            m = float(il.max())
            log_qs = il - (m + math.log(float(np.exp(il - m).sum())))
            loss = 0.0
            for j in range(len(support)):
                if p[j] > 0.0:
                    loss += p[j] * (math.log(p[j]) - log_qs[j])
            rows.append(dict(b=b, t=t, support=support, p=p, qs=np.exp(log_qs), loss=loss))
    return rows, I


def indexer_loss_oracle(
    index_q,
    index_k,
    index_weights,
    attn_q,
    attn_k,
    attn_lse,
    indices=None,
    *,
    index_scale=1.0,
    attn_scale,
    compress_ratio=1,
    q_offset=0,
    segment_ids=None,
    key_tokens=None,
    key_pool="sum",
) -> float:
    """DSA indexer distillation loss: mean over valid rows of KL(teacher || student).

    Args:
      index_q: [B, T, HI, DI]; index_k: [B, S, DI]; index_weights: [B, T, HI] or None.
      attn_q: [B, T, H, Dk]; attn_k: [B, S, G, Dk]; attn_lse: [B, T, H] or None
        (None only in dense form: per-head LSE over the support is used).
      indices: int [B, T, K] (sparse form; valid iff 0 <= idx < S, each
        occurrence is its own support slot) or None (dense form: support is
        every key visible under `visibility(...)`). compress_ratio, q_offset,
        segment_ids are used only in the dense form.
      index_scale, attn_scale: logit scales.
      key_tokens: int [B, T, K, P] or None (block form, QSA): support slot j's teacher mass is
        `key_pool` ("sum" or "max") over the per-key masses at attention keys key_tokens[b, t, j]
        (valid iff 0 <= token < attn_k's S); attn_k then holds those attention keys.

    Teacher p_j ∝ sum_h exp(attn_scale*<attn_q[b,t,h], attn_k[b,s_j,g(h)]> - attn_lse[b,t,h]);
    student log q_j = I_j - logsumexp_support(I). A row is valid iff its support
    is non-empty and sum u > 0.

    Returns:
      python float; 0.0 when no row is valid.
    """
    rows, _ = _indexer_rows(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices,
                            index_scale, attn_scale, compress_ratio, q_offset, segment_ids,
                            key_tokens, key_pool)
    if not rows:
        return 0.0
    return float(sum(r["loss"] for r in rows) / len(rows))


def indexer_loss_grads_oracle(
    index_q,
    index_k,
    index_weights,
    attn_q,
    attn_k,
    attn_lse,
    indices=None,
    *,
    index_scale=1.0,
    attn_scale,
    compress_ratio=1,
    q_offset=0,
    segment_ids=None,
    key_tokens=None,
    key_pool="sum",
):
    """Gradients of `indexer_loss_oracle` w.r.t. the indexer inputs (teacher is constant).

    Args: same as `indexer_loss_oracle`.

    Returns:
      d_index_q f64[B,T,HI,DI], d_index_k f64[B,S,DI],
      d_index_weights f64[B,T,HI] (None when index_weights is None).
    """
    iq = _f64(index_q)
    ik = _f64(index_k)
    B, T, HI, _ = iq.shape
    w = np.ones((B, T, HI)) if index_weights is None else _f64(index_weights)
    rows, _ = _indexer_rows(index_q, index_k, index_weights, attn_q, attn_k, attn_lse, indices,
                            index_scale, attn_scale, compress_ratio, q_offset, segment_ids,
                            key_tokens, key_pool)
    dq = np.zeros_like(iq)
    dk = np.zeros_like(ik)
    dw = np.zeros_like(w)
    n_valid = len(rows)
    for r in rows:
        b, t = r["b"], r["t"]
        gvec = (r["qs"] - r["p"]) / n_valid
        for j, s in enumerate(r["support"]):
            gj = float(gvec[j])
            for h in range(HI):
                a = float(iq[b, t, h] @ ik[b, s])
                dw[b, t, h] += index_scale * gj * max(a, 0.0)
                if a > 0.0:
                    dq[b, t, h] += index_scale * gj * w[b, t, h] * ik[b, s]
                    dk[b, s] += index_scale * gj * w[b, t, h] * iq[b, t, h]
    return dq, dk, (None if index_weights is None else dw)


# ---------------------------------------------------------------------------
# Grouped matmul (MoE experts): one matmul per run of rows
# ---------------------------------------------------------------------------
def grouped_matmul_oracle(lhs, rhs, group_sizes, dout=None, *, transpose_rhs=False):
    """out[r] = lhs[r] @ W_g for group g's rows (W_g = rhs[g], or rhs[g].T with transpose_rhs).

    Rows past sum(group_sizes) are 0. With `dout` f64[M, N] also returns the gradients
    (dlhs f64[M, K], drhs f64 like rhs) of sum(out * dout); rows past the sum get dlhs = 0.

    Returns:
      out f64[M, N], or (out, dlhs, drhs) when dout is given.
    """
    lhs, rhs = _f64(lhs), _f64(rhs)
    w = np.transpose(rhs, (0, 2, 1)) if transpose_rhs else rhs  # [G, K, N]
    M, N = lhs.shape[0], w.shape[2]
    out = np.zeros((M, N))
    dlhs, dw = np.zeros_like(lhs), np.zeros_like(w)
    start = 0
    for g, size in enumerate(np.asarray(group_sizes).tolist()):
        rows = slice(start, start + size)
        out[rows] = lhs[rows] @ w[g]
        if dout is not None:
            dlhs[rows] = _f64(dout)[rows] @ w[g].T
            dw[g] = lhs[rows].T @ _f64(dout)[rows]
        start += size
    if dout is None:
        return out
    return out, dlhs, (np.transpose(dw, (0, 2, 1)) if transpose_rhs else dw)


# ---------------------------------------------------------------------------
# Gated delta rule (Gated DeltaNet's recurrence), token by token
# ---------------------------------------------------------------------------
def gated_delta_rule_oracle(q, k, v, g, beta, *, scale, segment_ids=None, initial_state=None):
    """The recurrence per value head h (q/k head h // (Hv // Hk)), one token at a time:

        S = 0 where a document starts (segment id changes; t = 0 starts from initial_state)
        S = exp(g_t) S;  S = S + beta_t k_t (v_t - S^T k_t)^T;  out_t = S^T (scale q_t)

    Args: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; segment_ids int[B, T] or None;
    initial_state [B, Hv, Dk, Dv] or None.

    Returns:
      (out f64[B, T, Hv, Dv], final state f64[B, Hv, Dk, Dv]).
    """
    q, k, v, g, beta = map(_f64, (q, k, v, g, beta))
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    state = np.zeros((B, Hv, Dk, Dv)) if initial_state is None else _f64(initial_state).copy()
    out = np.zeros((B, T, Hv, Dv))
    for b in range(B):
        for t in range(T):
            if segment_ids is not None and t > 0 and segment_ids[b][t] != segment_ids[b][t - 1]:
                state[b] = 0.0
            for h in range(Hv):
                hk = _group_of(h, Hv, Hk)
                s = state[b, h] * math.exp(g[b, t, h])
                s = s + beta[b, t, h] * np.outer(k[b, t, hk], v[b, t, h] - s.T @ k[b, t, hk])
                state[b, h] = s
                out[b, t, h] = s.T @ (scale * q[b, t, hk])
    return out, state


def gated_deltanet_oracle(x, params, *, n_key_heads, key_dim, value_dim, eps, gate, segment_ids):
    """transformers' Qwen4-Exp Gated DeltaNet layer in float64, on packed documents.

    Args:
      x: [B, T, D] inputs.
      params: dict of arrays in our layout: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj
        ([in, out] matrices), conv1d [K, C] (tap K-1 is the current token), dt_bias [Hv], A_log [Hv],
        norm [Dv].
      gate: "sigmoid" or "silu" (the output gate's activation).
      segment_ids: int[B, T]; the conv window and the recurrence stop at document starts.

    Returns:
      f64[B, T, D].
    """
    p = {name: _f64(value) for name, value in params.items()}
    x = _f64(x)
    B, T, _ = x.shape
    Hk, Dk, Dv = n_key_heads, key_dim, value_dim
    Hv = p["A_log"].shape[0]
    mixed = x @ p["in_proj_qkv"]
    K = p["conv1d"].shape[0]
    conv = np.zeros_like(mixed)
    for b in range(B):
        for t in range(T):
            for j in range(K):
                s = t - (K - 1) + j
                if s >= 0 and segment_ids[b][s] == segment_ids[b][t]:
                    conv[b, t] += p["conv1d"][j] * mixed[b, s]
    conv = conv / (1.0 + np.exp(-conv))  # SiLU
    q = conv[..., : Hk * Dk].reshape(B, T, Hk, Dk)
    k = conv[..., Hk * Dk : 2 * Hk * Dk].reshape(B, T, Hk, Dk)
    v = conv[..., 2 * Hk * Dk :].reshape(B, T, Hv, Dv)
    l2 = lambda y: y / np.sqrt(np.sum(y * y, axis=-1, keepdims=True) + 1e-6)
    beta = 1.0 / (1.0 + np.exp(-(x @ p["in_proj_b"])))
    a = x @ p["in_proj_a"] + p["dt_bias"]
    g = -np.exp(p["A_log"]) * np.log1p(np.exp(a))
    out, _ = gated_delta_rule_oracle(l2(q), l2(k), v, g, beta, scale=Dk**-0.5, segment_ids=segment_ids)
    z = (x @ p["in_proj_z"]).reshape(B, T, Hv, Dv)
    act = 1.0 / (1.0 + np.exp(-z))
    act = act if gate == "sigmoid" else z * act
    out = out / np.sqrt(np.mean(out * out, axis=-1, keepdims=True) + eps) * p["norm"] * act
    return out.reshape(B, T, Hv * Dv) @ p["out_proj"]


def mtp_loss_oracle(main_hidden, targets, loss_mask, embedding, head, depths, *, eps):
  """float64 MTP loss (models/mtp.py): the mean over depths of each depth's masked cross-entropy.

  Depth d at position t embeds tok[t + 1 + d] = targets[t + d], predicts targets[t + 1 + d], and
  counts where loss_mask[t .. t + 1 + d] are all 1 (positions past T count 0), written with loops.

  Args:
    main_hidden: [B, T, D] the main model's normalised hidden state (depth 0's `prev`), or its
      residual streams [B, T, N, D] (DeepSeek-V4): the embedding then joins every stream, and the
      next depth takes the block's output streams.
    targets: int[B, T]; loss_mask: [B, T]; embedding: [V, D]; head: [D, V].
    depths: per depth a dict with `enorm`, `hnorm`, `norm` ([D] RMSNorm weights), `eh_proj` ([2D, D]),
      `block` (a callable, the decoder block, shape-preserving) and with streams `collapse` (a
      callable [B, T, N, D] -> [B, T, D] before `norm`).
  """
  h, targets, loss_mask = _f64(main_hidden), np.asarray(targets), _f64(loss_mask)
  E, W = _f64(embedding), _f64(head)
  B, T = h.shape[:2]
  rms = lambda x, w: x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(w)
  losses = []
  for d, depth in enumerate(depths):
    tokens = np.zeros((B, T), np.int64)
    for b in range(B):
      for t in range(T - d):
        tokens[b, t] = targets[b, t + d]
    e = rms(E[tokens], depth["enorm"])
    if h.ndim == 4:
      e = np.broadcast_to(e[:, :, None, :], h.shape)
    x = _f64(depth["block"](np.concatenate([e, rms(h, depth["hnorm"])], axis=-1) @ _f64(depth["eh_proj"])))
    out = rms(_f64(depth["collapse"](x)) if x.ndim == 4 else x, depth["norm"])
    h = x if x.ndim == 4 else out
    logits = out @ W
    total, count = 0.0, 0.0
    for b in range(B):
      for t in range(T):
        if t + 1 + d >= T or not all(loss_mask[b, t + j] for j in range(d + 2)):
          continue
        row = logits[b, t]
        lse = np.log(np.sum(np.exp(row - row.max()))) + row.max()
        total += lse - row[targets[b, t + 1 + d]]
        count += 1
    losses.append(total / max(count, 1.0))
  return float(np.mean(losses))
