"""One module per parallelism technique. Each knows its own options and torch, nothing else."""
