"""Defaults shared by every experiment; model files override only what differs."""

import dataclasses

import ml_collections

from hyscale_jax.model_config import ModelConfig


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # Which runnable task train.py hands the config to.
  config.task = ""

  # Backend per op: "auto" (pallas on GPU, reference elsewhere), "pallas", "reference", "xla_baseline".
  config.ops = ml_collections.ConfigDict()
  config.ops.flash_topk = "auto"
  config.ops.sparse_attention = "auto"
  config.ops.indexer_loss = "auto"
  # The dense warm-up stage's attention (ops.causal_attention).
  config.ops.causal_attention = "auto"
  # The MoE's expert matmuls (ops.grouped_matmul).
  config.ops.grouped_matmul = "auto"
  # Gated DeltaNet's recurrence (ops.gated_delta_rule).
  config.ops.gated_delta_rule = "auto"
  # A named preset that overrides `ops` and the remat/holistic `model` fields: "" (none),
  # "megatron_style", "+flashtopk", "+replay", "hyscale" or "+replay+<optimization>"
  # (hyscale_jax/training/step_modes.py).
  config.step_mode = ""

  # Device mesh: axis sizes whose product is the devices used (-1: the rest). The batch is split over
  # data x fsdp x expert, the sequence over context (context parallelism), routed experts over
  # expert (all-to-all dispatch), and parameters by `rules`.
  config.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, expert=1, context=1, tensor=1))
  # Logical axis -> mesh axis (None: replicated), the one place parameters and activations are
  # mapped to the mesh (hyscale_jax/sharding.py). A mesh axis splits at most one dimension of an
  # array: the first of its logical axes listed in the array's order wins.
  config.mesh.rules = (
      # Weights: FSDP over the model width and the low ranks, tensor parallelism over heads,
      # the FFN width and the vocabulary, experts over expert.
      ("embed", "fsdp"), ("q_lora", "fsdp"), ("kv_lora", "fsdp"),
      ("heads", "tensor"), ("kv_heads", None), ("mlp", "tensor"), ("vocab", "tensor"),
      ("exp", "expert"), ("index", None), ("norm", None),
      # Activations: batch over data x fsdp x expert, sequence over context, width whole.
      ("activation_batch", ("data", "fsdp", "expert")), ("activation_length", "context"),
      ("activation_embed", None),
  )

  # Start from these weights instead of a random init (when workdir has no checkpoint yet): a folder
  # written by `python -m hyscale_jax.convert import`, or a Hugging Face checkpoint folder.
  config.init_from = ""

  config.model = ml_collections.ConfigDict()
  # "selection_replay" (save the selection), "full" (Megatron-style: reselect in backward) or "none".
  config.model.remat_policy = "selection_replay"

  config.optim = ml_collections.ConfigDict()
  # Peak learning rate of the cosine schedule.
  config.optim.learning_rate = 1e-3
  # Linear warm-up steps of the learning rate.
  config.optim.lr_warmup_steps = 10
  # AdamW decoupled weight decay.
  config.optim.weight_decay = 0.0
  # Global-norm gradient clipping (0 disables).
  config.optim.grad_clip = 1.0

  config.data = ml_collections.ConfigDict()
  # Tokens per sequence.
  config.data.seq_len = 256
  # Sequences per step.
  config.data.batch_size = 4

  config.train = ml_collections.ConfigDict()
  # Seed for parameters and data order.
  config.train.seed = 0
  # Optimizer steps to run in total (a resumed run continues up to this count).
  config.train.steps = 100
  # Log metrics every this many steps.
  config.train.log_every = 10
  # Validation loss every this many steps, at a logged step, and at the last step (0: at every log).
  config.train.eval_every = 0
  # Steps (1-based) to trace with jax.profiler into <workdir>/profile/step_<N> (XProf / TensorBoard's
  # profile plugin; `python -m bench.profile_ops` sums a trace's device time per op and compares two).
  config.train.profile_steps = ()
  # The device's dense bf16 peak in TFLOP/s for the logged `mfu` (0: from the table of device kinds in
  # hyscale_jax/training/flops.py; no `mfu` where the kind is unknown, e.g. on a CPU).
  config.train.peak_tflops = 0.0
  # Save a checkpoint every this many steps (and at the end); 0 saves none.
  config.train.checkpoint_every = 50
  # Show a progress bar on stderr (on an interactive terminal; plain log lines otherwise).
  config.train.progress_bar = True
  # Exit cleanly once this step is reached (0: run to train.steps); the same config resumes later.
  config.train.stop_at_step = 0
  # On a non-finite loss or gradient: "skip" the step (state unchanged, counted) or "stop" with the
  # first non-finite tensor named.
  config.train.nonfinite = "stop"
  # Before compiling, estimate the per-device memory and stop with the knobs that would fit when it
  # clearly exceeds the device (hyscale_jax/training/memory.py).
  config.train.memory_preflight = True
  # Weight of the MTP loss (mean over model.mtp_depth depths) in the sparse stage's total; DeepSeek-V3
  # used 0.3, then 0.1 for the last part of training. Nothing when model.mtp_depth is 0.
  config.train.mtp_loss_weight = 0.3
  return config


def two_stage_lm(name: str, variant: str, full: dict, tiny: dict, *, full_seq_len: int,
                 full_learning_rate: float) -> ml_collections.ConfigDict:
  """The sparse-attention LM recipe on packed Shakespeare: a dense indexer warm-up, then sparse.

  Args:
    name: the config file's name, for errors.
    variant: "full" (the published architecture `full`, over `ModelConfig`'s defaults, at
      `full_seq_len` tokens per sequence) or "tiny" (`full` updated with `tiny`; trains on a CPU
      in minutes).
    full, tiny: model fields.
    full_seq_len, full_learning_rate: the full variant's sequence length and peak learning rate.
  """
  if variant not in ("tiny", "full"):
    raise ValueError(f"configs/{name}.py: unknown variant {variant!r}; use 'tiny' or 'full'.")
  is_tiny = variant == "tiny"
  model = dataclasses.asdict(ModelConfig(**full))
  if is_tiny:
    model.update(tiny)
  config = get_config()
  config.task = "lm"
  # Tuple fields stay tuples: the command line overrides tuples (`--config.model.compress_ratios="(0,4)"`),
  # not lists.
  config.model = ml_collections.ConfigDict(model)

  # "shakespeare" or "pydoc" (bundled, with a BPE of data.vocab_size trained on them), or the user's own
  # corpus (hyscale_jax/training/file_data.py): "jsonl" (data.path, tokenized with data.tokenizer) or
  # "tokens" (data.path: .npy or flat data.token_dtype binary; data.offsets: i64[D + 1] document bounds).
  # "": "jsonl" or "tokens" by data.path's suffix (.jsonl/.json, .npy/.bin), "shakespeare" without a path.
  config.data.source = ""
  config.data.vocab_size = config.model.vocab_size
  config.data.seq_len = 256 if is_tiny else full_seq_len
  config.data.batch_size = 8 if is_tiny else 1
  config.data.cache_dir = ""
  config.data.path = ""
  # tokenizer.json, or a folder holding one (an imported Hugging Face checkpoint).
  config.data.tokenizer = ""
  config.data.text_field = "text"
  config.data.offsets = ""  # "": <data.path stem>.offsets.npy
  config.data.token_dtype = "uint16"
  # End-of-document id (appended to each document, and padding); -1: the tokenizer's EOS token,
  # data.eos_token or, when "", the tokenizer_config.json beside it or a common name.
  config.data.eos_id = -1
  config.data.eos_token = ""

  # Indexer KL coefficient in the sparse stage, and the indexer's own learning rate.
  config.optim.indexer_loss_coeff = 1.0
  config.optim.indexer_learning_rate = 1e-3
  config.optim.learning_rate = 3e-3 if is_tiny else full_learning_rate
  config.optim.weight_decay = 0.01
  # Auxiliary-loss-free MoE balancing: router bias step per optimizer step.
  config.optim.router_bias_rate = 1e-3

  config.train.steps = 200 if is_tiny else 16000
  # Dense warm-up: indexer only, dense KL, attention not sparsified (architectures.md 1.6, 3.6).
  config.train.warmup_steps = 40 if is_tiny else 1000
  config.train.log_every = 10
  config.train.checkpoint_every = 50
  return config
