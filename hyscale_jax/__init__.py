"""HyScale-JAX: training framework for learned sparse attention at long context."""

from hyscale_jax import ops, remat

__all__ = ["ops", "remat"]
__version__ = "0.1.0"
