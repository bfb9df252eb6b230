"""Distributed checkpoints: atomic directories of torch.distributed.checkpoint shards."""
