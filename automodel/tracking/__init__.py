"""Metrics files, logs and (later) experiment trackers. Rank 0 owns all of them."""
