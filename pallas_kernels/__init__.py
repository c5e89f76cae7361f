"""Pallas GPU kernels, one folder per op; each is the `"pallas"` backend of `hyscale_jax.ops.<op>`."""

# Imported here, before anything is traced: Pallas imports its fuser lazily (its Mosaic interpreters
# and pipelines do, inside a kernel's first trace), and the fuser registers a JAX config option that
# is part of every jit cache key. Registered mid-run, it changed the key of an already compiled train
# step, which then traced and compiled again on its second call.
import jax.experimental.pallas.fuser  # noqa: E402, F401
