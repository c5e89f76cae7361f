"""The uniform-load bound of the MoE's grouped matmuls: the same per-expert products as one batched
dense matmul (issue 19; one device call, seconds).

    python bench/probe_grouped_matmul_dense_bound.py

With every expert taking the same rows, `bench/grouped_matmul.py`'s forward and dx are batched
matmuls [G, R, K] x [G, K, N]. This times them through XLA (`jnp.einsum`) and `torch.bmm` in one
process (device time: the profiler's kernel spans for XLA, CUDA events for torch; medians of 20
after a warm-up) and prints the cuBLAS kernel torch ran, whose name gives its tile, stages and
cluster. A grouped kernel cannot beat this on uniform loads; it measures how far ours is from it.
"""

import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, "bench")
from timing import timed  # noqa: E402

# (experts, rows an expert, K, N, the weights read transposed): forward and dx at bench shapes
PROBLEMS = {"qwen_16k forward": (512, 320, 2560, 640, False), "qwen_16k dx": (512, 320, 640, 2560, True),
            "dsv4_16k forward": (256, 384, 4096, 2048, False)}


def torch_bmm(g, r, k, n, transposed, reps=20):
  """(median seconds, cuBLAS kernel names) of torch.bmm at these shapes."""
  import torch  # noqa: PLC0415 - only on the device
  from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

  a = torch.randn(g, r, k, device="cuda", dtype=torch.bfloat16)
  # dx reads the weights [G, N, K] transposed, as a strided view (no copy), as the grouped kernel does
  b = (torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16).transpose(1, 2) if transposed
       else torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16))
  for _ in range(3):
    torch.bmm(a, b)
  torch.cuda.synchronize()
  seconds = []
  for _ in range(reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.bmm(a, b)
    end.record()
    torch.cuda.synchronize()
    seconds.append(start.elapsed_time(end) / 1e3)
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    torch.bmm(a, b)
    torch.cuda.synchronize()
  names = sorted({e.key for e in prof.key_averages() if "Memset" not in e.key})
  return sorted(seconds)[reps // 2], names


def main():
  key = jax.random.PRNGKey(0)
  for name, (g, r, k, n, transposed) in PROBLEMS.items():
    a = jax.random.normal(key, (g, r, k), jnp.bfloat16)
    b = jax.random.normal(key, (g, n, k) if transposed else (g, k, n), jnp.bfloat16)
    spec = "grk,gnk->grn" if transposed else "grk,gkn->grn"
    fn = jax.jit(lambda a, b, spec=spec: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(a.dtype))
    flops = 2 * g * r * k * n
    xla_s = timed(fn, a, b, reps=20)
    torch_s, kernels = torch_bmm(g, r, k, n, transposed)
    print(f"{name}: XLA {xla_s * 1e3:.3f} ms {flops / xla_s / 1e12:.1f} TFLOP/s; torch.bmm {torch_s * 1e3:.3f} ms "
          f"{flops / torch_s / 1e12:.1f} TFLOP/s ({', '.join(kernels)})", flush=True)


if __name__ == "__main__":
  main()
