"""Pallas GPU kernels, one folder per op; each is the `"pallas"` backend of `hyscale_jax.ops.<op>`."""
