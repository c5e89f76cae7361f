"""Shared by the FlashTopK tests: packed-document ids, the near-exact check of a selection against
the float64 oracle (DESIGN.md, "What exact means", random real-valued inputs), and the check that an
unsorted selection is the sorted one reordered."""

import numpy as np


def packed_segments(rng, B, T, n_seg):
  """Sorted packed-document ids, int32 [B, T]."""
  cuts = np.sort(rng.integers(1, T, size=(B, n_seg - 1)), axis=1)
  return np.stack([np.searchsorted(c, np.arange(T), side="right") for c in cuts]).astype(np.int32)


def assert_topk_near_exact(idx, sc, full, vis, o_idx, o_sc, name):
  """Selected sets may differ only at keys within float32 rounding of the k-th oracle score.

  idx, sc: a backend's (indices, scores) [B, Tq, topk]; full f64[B, Tq, Tk] the oracle's scores and
  vis bool[B, Tq, Tk] its visibility; o_idx, o_sc the oracle's selection; name labels failures.
  """
  idx, sc = np.asarray(idx), np.asarray(sc)
  B, Tq, _ = idx.shape
  for b in range(B):
    for t in range(Tq):
      n = int((o_idx[b, t] >= 0).sum())
      assert (idx[b, t, n:] == -1).all() and (sc[b, t, n:] == -np.inf).all(), (name, b, t)
      got, want = idx[b, t, :n], o_idx[b, t, :n]
      if n == 0:
        continue
      assert len(set(got.tolist())) == n and (got >= 0).all() and vis[b, t, got].all(), (name, b, t)
      row, kth = full[b, t], o_sc[b, t, n - 1]
      tol = 1e-5 * (1.0 + np.abs(row[vis[b, t]]).max())
      for s in set(got.tolist()) - set(want.tolist()):
        assert row[s] >= kth - tol, (name, b, t, s, row[s], kth)
      for s in set(want.tolist()) - set(got.tolist()):
        assert row[s] <= kth + tol, (name, b, t, s, row[s], kth)
      np.testing.assert_allclose(sc[b, t, :n], row[got], rtol=1e-5, atol=tol, err_msg=name)
      assert (np.diff(sc[b, t, :n]) <= 0).all(), (name, b, t)


def assert_reordered_selection(idx, sc, u_idx, u_sc) -> int:
  """The unsorted selection (u_idx, u_sc) [rows, topk] holds each row's sorted (idx, sc) pairs in
  another order, its empty slots (-1, -inf) still last. Returns how many rows differ in order."""
  reordered = 0
  for row in range(idx.shape[0]):
    order = np.lexsort((u_idx[row], -u_sc[row]))  # the op's order: score descending, index ascending
    np.testing.assert_array_equal(u_idx[row][order], idx[row], err_msg=f"row {row}")
    np.testing.assert_array_equal(u_sc[row][order], sc[row], err_msg=f"row {row}")
    n = (idx[row] >= 0).sum()
    assert (u_idx[row][:n] >= 0).all() and (u_idx[row][n:] == -1).all() and (u_sc[row][n:] == -np.inf).all()
    reordered += not np.array_equal(u_idx[row], idx[row])
  return reordered
