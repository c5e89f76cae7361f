"""The gated delta rule's Triton kernels (interpret mode on CPU) against the chunked reference and the
float64 oracle: values, final states and gradients, with packed documents and initial states; the
pallas backend lowered for a CUDA target; on the GPU (`-m gpu_only`), the same at real shapes."""

import dataclasses
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyscale_jax import ops
from hyscale_jax.ops.gated_delta_rule import REGISTRY
from hyscale_jax.ops.gated_delta_rule.reference import _chunk_step, chunk_terms, gated_delta_rule_reference
from hyscale_jax.ops.gated_delta_rule.scan_vjp import gated_delta_rule_with_scan_kernels
from pallas_kernels.gated_delta_rule import (
    Config,
    check_applies,
    gated_delta_rule_scan_bwd,
    gated_delta_rule_scan_fwd,
)

try:
  from tests.jaxpr_tools import export_for_h200
  from tests.oracles import gated_delta_rule_oracle
  from tests.test_gated_delta_rule import _inputs, _loss
except ImportError:  # tests/ itself is on sys.path
  from jaxpr_tools import export_for_h200
  from oracles import gated_delta_rule_oracle
  from test_gated_delta_rule import _inputs, _loss

# (B, T, Hk, Hv, Dk, Dv, documents, initial state): ragged T over grouped value heads with documents
# starting at a chunk's first token, inside one and as a single token; T below one chunk; two value
# blocks of the kernel (Dv 64 = 2 x 32); no documents and no initial state.
CASES = {
    "ragged_gqa_documents": (2, 37, 1, 2, 16, 16, (10, 16, 30), True),
    "below_one_chunk": (1, 7, 1, 1, 16, 16, (3,), True),
    "two_value_blocks": (1, 20, 1, 1, 16, 64, (5,), True),
    "plain": (1, 33, 2, 2, 16, 16, (), False),
}


def _case(name, seed=0):
  B, T, Hk, Hv, Dk, Dv, documents, state = CASES[name]
  return _inputs(seed, B, T, Hk, Hv, Dk, Dv, documents=documents, state=state)


@pytest.mark.parametrize("case", list(CASES))
def test_values_states_and_gradients_match_the_reference(case):
  q, k, v, g, beta, seg, s0 = _case(case)
  B, T, Hv, Dv = v.shape
  rng = np.random.default_rng(1)
  w_out = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
  w_state = jnp.asarray(rng.standard_normal((B, Hv, q.shape[-1], Dv)), jnp.float32)
  args = (q, k, v, g, beta, s0)
  argnums = range(6) if s0 is not None else range(5)
  got = jax.value_and_grad(_loss("pallas", chunk=16), argnums)(*args, seg, w_out, w_state)
  want = jax.value_and_grad(_loss("reference", chunk=16), argnums)(*args, seg, w_out, w_state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
  out, state = ops.gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=s0, chunk=16,
                                    return_final_state=True, backend="pallas")
  o_out, o_state = gated_delta_rule_oracle(q, k, v, g, beta, scale=q.shape[-1] ** -0.5,
                                           segment_ids=np.asarray(seg), initial_state=s0)
  assert out.shape == v.shape and out.dtype == jnp.float32 and state.shape == (B, Hv, q.shape[-1], Dv)
  np.testing.assert_allclose(out, o_out, rtol=1e-5, atol=2e-5)
  np.testing.assert_allclose(state, o_state, rtol=1e-5, atol=2e-5)


def test_bf16_inputs_return_bf16_close_to_the_oracle():
  q, k, v, g, beta, seg, s0 = _case("ragged_gqa_documents", seed=3)
  bf16 = lambda x: x.astype(jnp.bfloat16)
  out = ops.gated_delta_rule(bf16(q), bf16(k), bf16(v), g, bf16(beta), segment_ids=seg, initial_state=s0,
                             chunk=16, backend="pallas")
  want, _ = gated_delta_rule_oracle(q, k, v, g, beta, scale=0.25, segment_ids=np.asarray(seg), initial_state=s0)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.float32(out), want, atol=0.1)


def test_a_context_mesh_passes_the_state_between_pallas_shards_in_order():
  # 4 context shards of 16 tokens; documents start on shard 2's first token and inside shard 1.
  # Each shard runs the kernels twice (its state map with [I | 0] as the initial state, then its
  # output), so the initial and final states carry the whole sequence.
  q, k, v, g, beta, seg, s0 = _inputs(6, 2, 64, 1, 2, 16, 16, documents=(20, 32))
  w_out = jnp.asarray(np.random.default_rng(7).standard_normal(v.shape), jnp.float32)
  want = jax.jit(jax.value_and_grad(_loss("reference", chunk=16), range(6)))(q, k, v, g, beta, s0, seg, w_out, s0)
  mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  loss = jax.jit(jax.value_and_grad(_loss("pallas", chunk=16), range(6)))
  with jax.set_mesh(mesh):
    assert "shard_map" in str(jax.make_jaxpr(loss)(q, k, v, g, beta, s0, seg, w_out, s0))
    got = loss(q, k, v, g, beta, s0, seg, w_out, s0)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_the_gated_deltanet_layer_takes_the_pallas_backend_from_its_config():
  # The hybrid model's layer (16-dim heads, chunk 16), its values and parameter gradients by backend.
  from flax import nnx  # noqa: PLC0415

  from hyscale_jax.layers.gated_deltanet import GatedDeltaNet  # noqa: PLC0415

  try:
    from tests.test_gated_deltanet import _HYBRID, _segments, _x
  except ImportError:
    from test_gated_deltanet import _HYBRID, _segments, _x
  cfg = dataclasses.replace(_HYBRID, linear_key_dim=16, linear_value_dim=16, linear_chunk=16)
  graphdef, params = nnx.split(GatedDeltaNet(cfg, rngs=nnx.Rngs(0)))
  x, seg = _x(), _segments()

  def run(backend):
    backends = types.SimpleNamespace(gated_delta_rule=backend)
    f = lambda p: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(x, None, seg, backends=backends).out))
    return jax.jit(jax.value_and_grad(f))(params)

  for a, b in zip(jax.tree.leaves(run("pallas")), jax.tree.leaves(run("reference"))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_kernels_equal_the_scan_over_chunks_and_its_vjp():
  # The kernels alone, on the reference's own terms (head-major), against `lax.scan(_chunk_step)`
  # and its VJP: the custom_vjp's glue is then the only thing the op-level test adds.
  q, k, v, g, beta, seg, s0 = _case("two_value_blocks", seed=4)
  C, Dk, Dv = 16, q.shape[-1], v.shape[-1]
  terms = chunk_terms(q, k, v, g, beta, seg, scale=0.25, chunk=C, chunk_axis=0)  # [n, B, Hk, R, ...]

  def scan(terms, state0):
    final, out = jax.lax.scan(_chunk_step, state0, terms)
    return out, final

  state0 = s0.reshape(1, 1, 1, Dk, Dv)
  (out, final), vjp = jax.vjp(scan, terms, state0)
  rng = np.random.default_rng(5)
  dout, dfinal = (jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (out, final))
  dterms, dstate0 = vjp((dout, dfinal))
  head_major = lambda x: jnp.moveaxis(x, 0, 3).reshape(1, -1, *x.shape[5:])  # [BH, n C, X]
  flat_terms = tuple(x[:, 0, 0, 0][None] if x.ndim == 4 else head_major(x) for x in terms)
  k_out, states, k_final = gated_delta_rule_scan_fwd(flat_terms, s0.reshape(1, Dk, Dv), chunk=C,
                                                     config=Config(block_v=32))
  np.testing.assert_allclose(k_out, head_major(out), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(k_final[0], final.reshape(Dk, Dv), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(states[0, 0], s0[0, 0], rtol=0, atol=0)  # the state before chunk 0
  du, dstates, k_dstate0 = gated_delta_rule_scan_bwd(flat_terms, head_major(dout), dfinal.reshape(1, Dk, Dv),
                                                     chunk=C, config=Config(block_v=16))
  np.testing.assert_allclose(du, head_major(dterms[1]), rtol=1e-5, atol=1e-5)  # du0 = du
  np.testing.assert_allclose(k_dstate0[0], dstate0.reshape(Dk, Dv), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dstates[0, -1], dfinal.reshape(Dk, Dv), rtol=0, atol=0)


def test_declines_what_the_tiles_cannot_hold_and_validates_its_config():
  q, k, v, g, beta, seg, s0 = _case("plain")
  with pytest.raises(NotImplementedError, match="chunk=8"):
    ops.gated_delta_rule(q, k, v, g, beta, chunk=8, backend="pallas")
  with pytest.raises(NotImplementedError, match="Dk=12"):
    ops.gated_delta_rule(q[..., :12], k[..., :12], v, g, beta, chunk=16, backend="pallas")
  # Four rows of 64K tokens at Qwen's heads: the per-chunk states pass 2^31 elements.
  sd = jax.ShapeDtypeStruct
  big = [sd((4, 65536, 16, 128), jnp.bfloat16)] * 2 + [sd((4, 65536, 48, 128), jnp.bfloat16)]
  big += [sd((4, 65536, 48), jnp.float32)] * 2
  with pytest.raises(NotImplementedError, match="int32"):
    jax.eval_shape(lambda *a: ops.gated_delta_rule(*a, backend="pallas"), *big)
  for bad, match in ((dict(block_v=24), "block_v=24"), (dict(num_warps=3), "num_warps=3"),
                     (dict(precision="fp8"), "precision='fp8'")):
    with pytest.raises(ValueError, match=match):
      Config(**bad)


def test_auto_picks_pallas_on_gpu_only(monkeypatch):
  """The H200 bench measured pallas faster (docs/kernels/gated_delta_rule.md): auto takes it on GPU, with the
  reference behind it; on CPU auto stays the reference."""
  assert "pallas" in REGISTRY.implementations and REGISTRY.candidates("auto") == ("reference",)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert REGISTRY.candidates("auto") == ("pallas", "reference")


@pytest.mark.parametrize("T", [130, 1024])
def test_pallas_backend_lowers_for_cuda(T, monkeypatch):
  """Forward and gradients through `backend="pallas"` at Qwen3.8-Flash-Next's heads, lowered to Triton
  for an H200 on the CPU: one forward and one backward kernel, and T padded to whole chunks (130 is
  3 chunks of 64, 192 rows: Triton tiles only its loads, not the rows a program spans)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernels run compiled, not interpreted
  Hk, Hv, D = 16, 48, 128
  sd = jax.ShapeDtypeStruct
  args = ([sd((1, T, Hk, D), jnp.bfloat16)] * 2 + [sd((1, T, Hv, D), jnp.bfloat16), sd((1, T, Hv), jnp.float32),
          sd((1, T, Hv), jnp.bfloat16), sd((1, T), jnp.int32), sd((1, Hv, D, D), jnp.float32)])

  def loss(q, k, v, g, beta, seg, s0):
    out, state = ops.gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=s0,
                                      return_final_state=True, backend="pallas")
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(state)

  exported = export_for_h200(jax.grad(loss, range(5)), *args)
  names = re.findall(r'name = "(hyscale_[a-z_]+)"', exported.mlir_module())
  assert sorted(names) == ["hyscale_gated_delta_rule_bwd", "hyscale_gated_delta_rule_fwd"]
  assert [tuple(a.shape) for a in exported.out_avals] == [tuple(a.shape) for a in args[:5]]


@pytest.mark.parametrize("config", [Config(precision="ieee"), Config(block_v=64, num_warps=8, precision="tf32x3"),
                                    Config(block_v=16, num_stages=3, precision="tf32")])
def test_kernel_configs_lower_for_cuda(config, monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  BH, n, C, D = 4, 3, 64, 128
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  terms = (f32(BH, n * C, D), f32(BH, n * C, D), f32(BH, n * C, D), f32(BH, n * C, C), f32(BH, n), f32(BH, n * C, D))

  def both(terms, state0, dout):
    out, states, final = gated_delta_rule_scan_fwd(terms, state0, chunk=C, config=config)
    return out, states, gated_delta_rule_scan_bwd(terms, dout, final, chunk=C, config=config)

  exported = export_for_h200(both, terms, f32(BH, D, D), f32(BH, n * C, D))
  assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 2
  assert [tuple(a.shape) for a in exported.out_avals] == [(BH, n * C, D), (BH, n, D, D)] * 2 + [(BH, D, D)]


# ---- GPU only: compiled Triton kernels at real shapes ----

def _on_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA device")


@pytest.mark.gpu_only
@pytest.mark.parametrize("precision, tol", [("ieee", 2e-4), ("tf32", 3e-2)])
def test_gpu_values_and_gradients_at_the_qwen_shape(precision, tol):
  """4096 tokens, 3 documents, an initial state, Qwen3.8-Flash-Next's 16/48 heads of 128, chunk 64:
  the compiled kernels against the reference in f32 (tests run XLA at "highest"), to f32 rounding
  with f32 dots in the kernel and to tf32's with tf32 dots; errors relative to each array's largest."""
  _on_gpu()
  config = dataclasses.replace(Config.heuristics(128, 128, 64), precision=precision)
  pallas = functools.partial(gated_delta_rule_with_scan_kernels,
                             functools.partial(gated_delta_rule_scan_fwd, config=config),
                             functools.partial(gated_delta_rule_scan_bwd, config=config),
                             functools.partial(check_applies, config=config))
  q, k, v, g, beta, seg, s0 = _inputs(8, 1, 4096, 16, 48, 128, 128, documents=(1000, 2900))
  rng = np.random.default_rng(9)
  w_out, w_state = (jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (v, s0))

  def loss(rule):
    def f(*args):
      out, state = rule(*args[:5], scale=128**-0.5, segment_ids=seg, initial_state=args[5], chunk=64)
      return jnp.sum(out * w_out) + jnp.sum(state * w_state)
    return jax.jit(jax.value_and_grad(f, range(6)))

  got, want = loss(pallas)(q, k, v, g, beta, s0), loss(gated_delta_rule_reference)(q, k, v, g, beta, s0)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    scale = float(np.abs(b).max()) or 1.0
    np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, atol=tol)


def test_bench_records_a_failing_pallas_config_as_an_error_row(tmp_path):
  """bench/gated_delta_rule.py keeps going when a pallas config cannot run (block_v 32 > Dv 16 at the
  smoke shape stands in for a Triton compile error on the GPU): an `error` row, reference rows intact."""
  import importlib.util  # noqa: PLC0415
  import json  # noqa: PLC0415
  import pathlib  # noqa: PLC0415

  path = pathlib.Path(__file__).parents[1] / "bench" / "gated_delta_rule.py"
  spec = importlib.util.spec_from_file_location("bench_gated_delta_rule", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = tmp_path / "rows.json"
  try:
    bench.main(["--smoke", "--backends", "reference", "--pallas-configs", "32,4,1", "--out", str(out)])
  finally:
    REGISTRY.implementations.pop("pallas[32,4,1]", None)
  rows = json.loads(out.read_text())["rows"]
  assert [(r["backend"], r["pass"], "error" in r) for r in rows] == [
      ("reference", "fwd", False), ("reference", "fwd+bwd", False),
      ("pallas[32,4,1]", "fwd", True), ("pallas[32,4,1]", "fwd+bwd", True)]
  assert "block_v=32 does not divide Dv=16" in rows[2]["error"] and rows[0]["ms"] > 0
