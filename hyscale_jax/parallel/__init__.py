"""Parallelism over device meshes with `jax.shard_map` (context parallelism first)."""

from hyscale_jax.parallel.mesh import (
    MESH_AXES, batch_sharding, check_same_config, global_batch, make_mesh, maybe_initialize_distributed, mesh_shape,
    process_rows,
)
from hyscale_jax.parallel.context import (
    LAYOUTS, causal_work, context_parallel_flash_topk, context_parallel_sparse_attention, from_layout,
    to_layout,
)

__all__ = ["MESH_AXES", "batch_sharding", "check_same_config", "global_batch", "make_mesh", "maybe_initialize_distributed",
           "mesh_shape", "process_rows", "LAYOUTS", "causal_work", "context_parallel_flash_topk", "context_parallel_sparse_attention",
           "from_layout", "to_layout"]
