"""Training: loop pieces (checkpoints, metrics, data) and the runnable tasks built on them."""
