"""Self-checks for the float64 NumPy oracles in tests/oracles.py.

Each oracle is checked against an independent brute force, a closed-form
identity, or central finite differences of another oracle.
"""

import numpy as np
import pytest

try:
    from tests import oracles as O
except ImportError:  # pragma: no cover - depends on how pytest sets sys.path
    import oracles as O


def _fd_grad(f, x, eps=1e-6):
    """Central finite-difference gradient of scalar f() w.r.t. array x (mutated in place)."""
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


# ---------------------------------------------------------------------------
# 1. index_scores / visibility
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("use_w", [True, False])
def test_index_scores_brute(use_w):
    rng = np.random.default_rng(0)
    B, Tq, Tk, H, D = 2, 3, 5, 3, 4
    q = rng.normal(size=(B, Tq, H, D)).astype(np.float32)
    k = rng.normal(size=(B, Tk, D)).astype(np.float32)
    w = rng.normal(size=(B, Tq, H)) if use_w else None
    got = O.index_scores(q, k, w, 0.7)
    assert got.dtype == np.float64 and got.shape == (B, Tq, Tk)
    for b in range(B):
        for t in range(Tq):
            for s in range(Tk):
                acc = 0.0
                for h in range(H):
                    dot = sum(float(q[b, t, h, d]) * float(k[b, s, d]) for d in range(D))
                    acc += (1.0 if w is None else w[b, t, h]) * max(dot, 0.0)
                np.testing.assert_allclose(got[b, t, s], 0.7 * acc, rtol=1e-12, atol=1e-12)


def test_visibility_brute():
    rng = np.random.default_rng(1)
    B, Tq, Tk = 2, 7, 9
    seg = (rng.integers(0, 2, (B, Tq)), rng.integers(0, 2, (B, Tk)))
    for cr, off, sg in [(1, 0, None), (4, 0, None), (4, 5, None), (2, 3, seg), (1, 2, seg)]:
        got = O.visibility(B, Tq, Tk, compress_ratio=cr, q_offset=off, segment_ids=sg)
        assert got.dtype == bool and got.shape == (B, Tq, Tk)
        for b in range(B):
            for t in range(Tq):
                for s in range(Tk):
                    want = (s + 1) * cr <= off + t + 1
                    if sg is not None:
                        want = want and sg[0][b, t] == sg[1][b, s]
                    assert got[b, t, s] == want


# ---------------------------------------------------------------------------
# 2. topk
# ---------------------------------------------------------------------------


def _topk_brute(q, k, w, topk, cr, off, seg, scale):
    """Selection by repeated max over a plain Python loop on exact integer scores."""
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    idx = np.full((B, Tq, topk), -1, np.int64)
    sc = np.full((B, Tq, topk), -np.inf)
    for b in range(B):
        for t in range(Tq):
            cand = {}
            for s in range(Tk):
                vis = (s + 1) * cr <= off + t + 1
                if seg is not None and seg[0][b, t] != seg[1][b, s]:
                    vis = False
                if not vis:
                    continue
                acc = 0
                for h in range(H):
                    dot = sum(int(q[b, t, h, d]) * int(k[b, s, d]) for d in range(D))
                    acc += (1 if w is None else int(w[b, t, h])) * max(dot, 0)
                cand[s] = scale * acc
            for j in range(min(topk, len(cand))):
                best = None
                for s in sorted(cand):
                    if best is None or cand[s] > cand[best]:
                        best = s
                idx[b, t, j], sc[b, t, j] = best, cand.pop(best)
    return idx, sc


@pytest.mark.parametrize(
    "topk,cr,off,use_seg,use_w",
    [(4, 1, 0, False, True), (6, 1, 3, False, True), (3, 4, 0, False, True),
     (5, 4, 9, True, True), (8, 1, 0, True, False), (40, 2, 1, False, True)],
)
def test_topk_vs_brute(topk, cr, off, use_seg, use_w):
    rng = np.random.default_rng(topk * 100 + cr * 10 + off)
    B, Tq, Tk, H, D = 2, 12, 16, 3, 2
    # small integers -> lots of exact ties; mostly-negative dots / negative
    # weights produce the ReLU zero plateau (and -0.0 vs +0.0 scores).
    q = rng.integers(-2, 2, (B, Tq, H, D)).astype(np.float32)
    k = rng.integers(-1, 2, (B, Tk, D)).astype(np.float32)
    w = rng.integers(-2, 3, (B, Tq, H)).astype(np.float32) if use_w else None
    seg = (rng.integers(0, 3, (B, Tq)), rng.integers(0, 3, (B, Tk))) if use_seg else None
    idx, sc = O.topk_oracle(q, k, w, topk=topk, compress_ratio=cr, q_offset=off,
                            segment_ids=seg, scale=0.5)
    assert idx.dtype == np.int32 and idx.shape == (B, Tq, topk)
    assert sc.dtype == np.float64 and sc.shape == (B, Tq, topk)
    bidx, bsc = _topk_brute(q, k, w, topk, cr, off, seg, 0.5)
    np.testing.assert_array_equal(idx, bidx)
    np.testing.assert_array_equal(sc, bsc)
    assert (idx == -1).any()  # short rows exercised in every config
    assert ((sc == 0) & (idx >= 0)).any()  # zero plateau exercised


def test_topk_signed_zero_ties():
    # Head weights -1 on a relu-zero dot give -0.0; +1 give +0.0. They must tie.
    q = np.array([[[[1.0]]]])  # B=1,Tq=1,H=1,D=1
    k = np.array([[[-1.0], [-2.0], [-3.0]]])  # all dots negative -> relu 0
    w = np.array([[[-1.0]]])
    idx, sc = O.topk_oracle(q, k, w, topk=3, q_offset=2)
    assert O.index_scores(q, k, w, 1.0)[0, 0, 0] == 0.0
    np.testing.assert_array_equal(idx[0, 0], [0, 1, 2])
    np.testing.assert_array_equal(sc[0, 0], [0.0, 0.0, 0.0])


# ---------------------------------------------------------------------------
# 3. sparse attention
# ---------------------------------------------------------------------------


def _dense_causal(q, k, v, scale):
    B, T, H, _ = q.shape
    G = k.shape[2]
    kk = np.repeat(k, H // G, axis=2)
    vv = np.repeat(v, H // G, axis=2)
    logits = scale * np.einsum("bthd,bshd->bhts", q, kk)
    mask = np.tril(np.ones((T, k.shape[1]), bool))
    logits = np.where(mask, logits, -np.inf)
    m = logits.max(-1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(-1, keepdims=True))
    out = np.einsum("bhts,bshd->bthd", np.exp(logits - lse), vv)
    return out, lse[..., 0].transpose(0, 2, 1)


@pytest.mark.parametrize("G", [1, 2])
def test_sparse_attention_causal_equals_dense(G):
    rng = np.random.default_rng(2)
    B, T, H, Dk, Dv = 2, 7, 4, 5, 3
    q = rng.normal(size=(B, T, H, Dk))
    k = rng.normal(size=(B, T, G, Dk))
    v = rng.normal(size=(B, T, G, Dv))
    ind = np.full((B, T, T), -1)
    for t in range(T):
        ind[:, t, : t + 1] = rng.permutation(t + 1)  # order must not matter
    out, lse = O.sparse_attention_oracle(q, k, v, ind, scale=0.4)
    rout, rlse = _dense_causal(q, k, v, 0.4)
    np.testing.assert_allclose(out, rout, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, rlse, rtol=1e-12, atol=1e-12)


def test_sparse_attention_duplicates_sinks_empty():
    rng = np.random.default_rng(3)
    B, T, S, H, G, D = 1, 3, 5, 2, 1, 4
    q, k, v = (rng.normal(size=(B, T, H, D)), rng.normal(size=(B, S, G, D)),
               rng.normal(size=(B, S, G, D)))
    ind = np.array([[[2, 2, 4, -1], [7, -1, -1, -3], [0, 1, 3, 3]]])  # row 1 empty (7 >= S)
    sinks = np.array([0.3, -1.2])
    out, lse = O.sparse_attention_oracle(q, k, v, ind, scale=0.5)
    out_s, lse_s = O.sparse_attention_oracle(q, k, v, ind, scale=0.5, sinks=sinks)
    # duplicates: one softmax slot per occurrence
    for h in range(H):
        lg = 0.5 * np.array([q[0, 0, h] @ k[0, s, 0] for s in (2, 2, 4)])
        p = np.exp(lg - lg.max()) / np.exp(lg - lg.max()).sum()
        np.testing.assert_allclose(out[0, 0, h], p @ v[0, [2, 2, 4], 0], rtol=1e-12)
        np.testing.assert_allclose(lse[0, 0, h], lg.max() + np.log(np.exp(lg - lg.max()).sum()))
    # empty row
    assert np.all(out[0, 1] == 0) and np.all(np.isneginf(lse[0, 1]))
    assert np.all(out_s[0, 1] == 0)
    np.testing.assert_array_equal(lse_s[0, 1], sinks)
    # sink identity: lse_s = logaddexp(lse, sink); out_s = out * exp(lse - lse_s)
    np.testing.assert_allclose(lse_s, np.logaddexp(lse, sinks[None, None]), rtol=1e-12)
    np.testing.assert_allclose(out_s, out * np.exp(lse - lse_s)[..., None], rtol=1e-12, atol=1e-15)
    assert not np.isnan(out).any() and not np.isnan(out_s).any() and not np.isnan(lse_s).any()


@pytest.mark.parametrize("G,use_sinks,use_dlse", [(1, False, True), (2, True, True),
                                                  (2, False, False), (1, True, False)])
def test_sparse_attention_grads_fd(G, use_sinks, use_dlse):
    rng = np.random.default_rng(10 * G + 2 * use_sinks + use_dlse)
    B, T, S, H, Dk, Dv = 2, 4, 6, 4, 3, 2
    q = rng.normal(size=(B, T, H, Dk))
    k = rng.normal(size=(B, S, G, Dk))
    v = rng.normal(size=(B, S, G, Dv))
    ind = rng.integers(-1, S, size=(B, T, 5))
    ind[0, 0] = [1, 1, 1, -1, 4]  # duplicates + skip
    ind[1, 2] = [-1, -1, S, S + 3, -1]  # empty row
    sinks = rng.normal(size=(H,)) if use_sinks else None
    dout = rng.normal(size=(B, T, H, Dv))
    dlse = rng.normal(size=(B, T, H)) if use_dlse else None

    def loss():
        out, lse = O.sparse_attention_oracle(q, k, v, ind, scale=0.6, sinks=sinks)
        val = float((out * dout).sum())
        if dlse is not None:
            val += float(np.where(np.isfinite(lse), lse * dlse, 0.0).sum())
        return val

    dq, dk, dv, ds = O.sparse_attention_grads_oracle(q, k, v, ind, dout, dlse, scale=0.6,
                                                     sinks=sinks)
    for arr, g in [(q, dq), (k, dk), (v, dv)] + ([(sinks, ds)] if use_sinks else []):
        np.testing.assert_allclose(g, _fd_grad(loss, arr), rtol=1e-6, atol=1e-7)
    if not use_sinks:
        assert ds is None
    assert np.all(dq[1, 2] == 0)  # empty row contributes nothing to dq


# ---------------------------------------------------------------------------
# 4. indexer KL loss
# ---------------------------------------------------------------------------


def _indexer_inputs(seed, B=2, T=5, S=6, HI=2, DI=3, H=2, G=1, Dk=3, kink_free=True):
    rng = np.random.default_rng(seed)
    while True:
        iq = rng.normal(size=(B, T, HI, DI))
        ik = rng.normal(size=(B, S, DI))
        if not kink_free or np.abs(np.einsum("bthd,bsd->bths", iq, ik)).min() > 1e-3:
            break
    iw = rng.normal(size=(B, T, HI))
    aq = rng.normal(size=(B, T, H, Dk))
    ak = rng.normal(size=(B, S, G, Dk))
    alse = rng.normal(size=(B, T, H)) + 1.0
    return iq, ik, iw, aq, ak, alse


def test_indexer_loss_zero_when_student_matches_teacher():
    rng = np.random.default_rng(4)
    B, T, S, D = 2, 4, 5, 3
    aq = np.abs(rng.normal(size=(B, T, 1, D))) + 0.1  # positive -> relu is identity
    ak = np.abs(rng.normal(size=(B, S, 1, D))) + 0.1
    alse = rng.normal(size=(B, T, 1))
    kw = dict(index_scale=0.8, attn_scale=0.8)
    ind = np.array([[[0, 0, 3, -1]] * T, [[4, 2, 2, 1]] * T])
    for indices, lse in [(None, None), (None, alse), (ind, alse)]:
        loss = O.indexer_loss_oracle(aq, ak[:, :, 0], None, aq, ak, lse, indices, **kw)
        assert abs(loss) < 1e-12
        grads = O.indexer_loss_grads_oracle(aq, ak[:, :, 0], None, aq, ak, lse, indices, **kw)
        assert max(np.abs(grads[0]).max(), np.abs(grads[1]).max()) < 1e-12
    # mismatched student -> strictly positive KL
    assert O.indexer_loss_oracle(aq, ak[:, :, 0], None, aq, ak, None, index_scale=0.1,
                                 attn_scale=0.8) > 1e-6


def test_indexer_loss_identities():
    iq, ik, iw, aq, ak, alse = _indexer_inputs(5, T=6, S=6, H=4, G=2, kink_free=False)
    B, T, S = 2, 6, 6
    seg = (np.array([[0, 0, 0, 1, 1, 1]] * B), np.array([[0, 0, 0, 1, 1, 1]] * B))
    kw = dict(index_scale=0.7, attn_scale=0.9, compress_ratio=2, q_offset=1, segment_ids=seg)
    loss = O.indexer_loss_oracle(iq, ik, iw, aq, ak, alse, **kw)
    assert loss >= 0.0
    # mean over valid rows of single-row losses
    vis = O.visibility(B, T, S, compress_ratio=2, q_offset=1, segment_ids=seg)
    per_row = []
    for b in range(B):
        for t in range(T):
            if vis[b, t].any():
                sub = dict(kw, q_offset=1 + t, segment_ids=(seg[0][b:b + 1, t:t + 1], seg[1][b:b + 1]))
                per_row.append(O.indexer_loss_oracle(
                    iq[b:b + 1, t:t + 1], ik[b:b + 1], iw[b:b + 1, t:t + 1],
                    aq[b:b + 1, t:t + 1], ak[b:b + 1], alse[b:b + 1, t:t + 1], **sub))
    assert 0 < len(per_row) < B * T  # some rows are empty
    np.testing.assert_allclose(loss, np.mean(per_row), rtol=1e-12)
    # teacher invariant to a per-row shift of attn_lse shared by all heads
    shift = np.random.default_rng(6).normal(size=(B, T, 1))
    np.testing.assert_allclose(O.indexer_loss_oracle(iq, ik, iw, aq, ak, alse + shift, **kw),
                               loss, rtol=1e-12)
    # sparse form listing exactly the visible keys == dense form
    ind = np.full((B, T, S), -1)
    for b in range(B):
        for t in range(T):
            vs = np.nonzero(vis[b, t])[0]
            ind[b, t, : len(vs)] = vs[::-1]
    sparse = O.indexer_loss_oracle(iq, ik, iw, aq, ak, alse, ind, index_scale=0.7, attn_scale=0.9)
    np.testing.assert_allclose(sparse, loss, rtol=1e-12)
    # no valid row -> 0.0
    assert O.indexer_loss_oracle(iq, ik, iw, aq, ak, alse, np.full((B, T, 3), -1),
                                 attn_scale=0.9) == 0.0
    # attn_lse=None is only defined for the dense form
    with pytest.raises(ValueError):
        O.indexer_loss_oracle(iq, ik, iw, aq, ak, None, ind, attn_scale=0.9)


@pytest.mark.parametrize("form,use_w", [("sparse", True), ("sparse", False),
                                        ("dense", True), ("dense", False)])
def test_indexer_loss_grads_fd(form, use_w):
    iq, ik, iw, aq, ak, alse = _indexer_inputs(7 + use_w, H=4, G=2)
    B, T, S = 2, 5, 6
    iw = iw if use_w else None
    if form == "sparse":
        ind = np.random.default_rng(8).integers(-1, S, size=(B, T, 4))
        ind[0, 1] = [3, 3, 0, -1]  # duplicate slots
        ind[1, 0] = [-1, -1, -1, -1]  # empty row
        kw = dict(indices=ind, index_scale=0.8, attn_scale=0.7)
        lse = alse
    else:
        seg = (np.array([[0, 0, 1, 1, 1]] * B), np.array([[0, 0, 0, 1, 1, 1]] * B))
        kw = dict(index_scale=0.8, attn_scale=0.7, q_offset=1, segment_ids=seg)
        lse = None

    def loss():
        return O.indexer_loss_oracle(iq, ik, iw, aq, ak, lse, **kw)

    dq, dk, dw = O.indexer_loss_grads_oracle(iq, ik, iw, aq, ak, lse, **kw)
    np.testing.assert_allclose(dq, _fd_grad(loss, iq), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(dk, _fd_grad(loss, ik), rtol=1e-5, atol=1e-8)
    if use_w:
        np.testing.assert_allclose(dw, _fd_grad(loss, iw), rtol=1e-5, atol=1e-8)
    else:
        assert dw is None
    assert np.abs(dq).max() > 1e-4  # non-trivial gradient
