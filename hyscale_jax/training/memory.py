"""Per-device training memory, estimated from the model's shapes before anything is compiled.

The estimate adds, per device:
- parameters, gradients and the two AdamW moments (param dtype), divided over `param_shards`;
- what the per-layer `jax.checkpoint` keeps for the backward pass: each layer's input, and under
  `"selection_replay"` (or `"none"`) the selection and the attention's out/lse of every layer;
- the f32 logits and their gradient;
- the largest transient of one layer: the all-gathered key rows under context parallelism and the
  MoE's dispatched token copies (x3 for the expert SwiGLU).
It is an estimate of the dominant terms, not of XLA's exact buffer assignment.
"""

from __future__ import annotations

import dataclasses
import math

import os

import jax
import jax.numpy as jnp

from hyscale_jax.model_config import ModelConfig
from hyscale_jax.sharding import BATCH_AXES


def _attention_dims(cfg: ModelConfig) -> tuple[int, int, int]:
  """(selected keys per query, attention-output width per head, key-row width) for cfg's family."""
  if cfg.architecture == "deepseek_v4":
    return cfg.sliding_window + cfg.index_topk, cfg.head_dim, cfg.head_dim
  if cfg.architecture == "qwen4_exp":
    return cfg.index_topk * cfg.qsa_block + cfg.qsa_block - 1, cfg.head_dim, 2 * cfg.n_kv_heads * cfg.head_dim
  return cfg.index_topk, cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_dim


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes per device, by component."""

  components: dict

  @property
  def total(self) -> int:
    return int(sum(self.components.values()))

  def describe(self) -> str:
    parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in sorted(self.components.items(), key=lambda kv: -kv[1]))
    return f"{self.total / 2**30:.2f} GiB ({parts} GiB)"


def estimate_training_memory(cfg: ModelConfig, *, batch_size: int, seq_len: int, data_shards: int = 1,
                             context_shards: int = 1, param_shards: int = 1,
                             param_count: int | None = None) -> MemoryEstimate:
  """Estimated bytes per device of one training step (see the module docstring).

  Args:
    cfg: the model.
    batch_size, seq_len: the global batch.
    data_shards, context_shards: how the batch and the sequence are split over devices.
    param_shards: how many devices share each parameter (1 = replicated).
    param_count: total parameters, if already known (else counted on abstract shapes).
  """
  if param_count is None:
    from hyscale_jax import models  # noqa: PLC0415 (models imports the layers; keep this module light)
    param_count = models.count_params(cfg)[0]
  p_bytes, a_bytes = jnp.dtype(cfg.param_dtype).itemsize, jnp.dtype(cfg.dtype).itemsize
  rows = batch_size / data_shards * seq_len / context_shards  # tokens on this device
  selected, out_width, key_width = _attention_dims(cfg)
  saves_attention = cfg.remat_policy in ("selection_replay", "none")
  components = {
      "parameters": param_count * p_bytes / param_shards,
      "gradients": param_count * p_bytes / param_shards,
      "optimizer": 2 * param_count * p_bytes / param_shards,
      # With hyper-connections each layer's saved input is its hc_mult residual streams.
      "layer inputs": cfg.n_layers * rows * cfg.d_model * max(cfg.hc_mult, 1) * a_bytes,
      "saved selection and attention": (cfg.n_layers * rows * (selected * 4 + cfg.n_heads * (out_width * a_bytes + 4))
                                        if saves_attention else 0),
      "logits": 2 * rows * cfg.vocab_size * 4,
      "one layer's transients": max(batch_size / data_shards * seq_len * key_width * a_bytes,
                                    3 * rows * cfg.experts_per_token * cfg.moe_inter * a_bytes),
  }
  return MemoryEstimate({k: int(v) for k, v in components.items()})


def device_memory_bytes(device: jax.Device | None = None) -> int | None:
  """What one device can hold: the allocator's limit on an accelerator, physical RAM on a CPU."""
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  try:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // max(jax.local_device_count(), 1)
  except (ValueError, OSError, AttributeError):
    return None


def preflight(cfg: ModelConfig, *, batch_size: int, seq_len: int, mesh_shape: dict, available: int | None,
              headroom: float = 1.0) -> MemoryEstimate:
  """Raises MemoryError, before compiling, when the estimate clearly exceeds `available` bytes.

  The message gives the estimate by component and the knobs that would fit: `remat_policy=full`,
  a larger `mesh.context` (for the devices it would take), or a shorter `data.seq_len`.
  """
  from hyscale_jax import models  # noqa: PLC0415

  count = models.count_params(cfg)[0]
  # The batch is split over BATCH_AXES (data x fsdp x expert); parameters at least over fsdp x tensor (the
  # default rules; experts also over expert, which this lower bound leaves out).
  split = dict(data_shards=math.prod(mesh_shape.get(axis, 1) for axis in BATCH_AXES),
               context_shards=mesh_shape.get("context", 1), param_count=count,
               param_shards=mesh_shape.get("fsdp", 1) * mesh_shape.get("tensor", 1))
  estimate = estimate_training_memory(cfg, batch_size=batch_size, seq_len=seq_len, **split)
  if available is None or estimate.total <= headroom * available:
    return estimate
  fits = lambda e: e.total <= headroom * available
  knobs = []
  if cfg.remat_policy != "full":
    full = estimate_training_memory(dataclasses.replace(cfg, remat_policy="full"), batch_size=batch_size,
                                    seq_len=seq_len, **split)
    knobs.append(f"--config.model.remat_policy=full: {full.total / 2**30:.2f} GiB" + ("" if fits(full) else " (still too much)"))
  for context in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
    if context <= split["context_shards"] or seq_len % context:
      continue
    e = estimate_training_memory(cfg, batch_size=batch_size, seq_len=seq_len, **{**split, "context_shards": context})
    if fits(e):
      knobs.append(f"--config.mesh.context={context} ({context} devices per sequence): {e.total / 2**30:.2f} GiB")
      break
  shorter = seq_len // 2
  while shorter >= 1:
    e = estimate_training_memory(cfg, batch_size=batch_size, seq_len=shorter, **split)
    if fits(e):
      knobs.append(f"--config.data.seq_len={shorter}: {e.total / 2**30:.2f} GiB")
      break
    shorter //= 2
  weights = estimate.components["parameters"] + estimate.components["gradients"] + estimate.components["optimizer"]
  if weights > headroom * available:
    knobs.append(f"the parameters, gradients and AdamW state alone take {weights / 2**30:.2f} GiB per device: "
                 "they need sharding over more devices (a larger --config.mesh.fsdp) or a smaller model")
  raise MemoryError(
      f"memory preflight: this step needs about {estimate.describe()} per device, more than the "
      f"{available / 2**30:.2f} GiB available. Knobs: " + "; ".join(knobs) + ". "
      "Set --config.train.memory_preflight=false to try anyway.")


__all__ = ["MemoryEstimate", "device_memory_bytes", "estimate_training_memory", "preflight"]
