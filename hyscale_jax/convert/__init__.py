"""Hugging Face checkpoint interop: `import_checkpoint` / `load_weights` stream a checkpoint folder into
our model, `export_checkpoint` writes one back (bit for bit round trip). CLI: `python -m hyscale_jax.convert`.
"""

from hyscale_jax.convert.api import (CHECKPOINT_VARIABLES, TOKENIZER_FILES, CheckpointMismatchError,
                                     abstract_model, config_mismatches, copy_tokenizer, export_checkpoint,
                                     import_checkpoint, load_weights, read_config)
from hyscale_jax.convert.hf_config import UnsupportedConfigError, from_hf, to_hf
from hyscale_jax.convert.native import load_native, load_pretrained, save_native

__all__ = ["CHECKPOINT_VARIABLES", "TOKENIZER_FILES", "CheckpointMismatchError", "UnsupportedConfigError",
           "abstract_model", "config_mismatches", "copy_tokenizer", "export_checkpoint", "from_hf",
           "import_checkpoint", "load_native", "load_pretrained", "load_weights", "read_config", "save_native",
           "to_hf"]
