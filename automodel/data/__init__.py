"""Token sources (shipped corpus, synthetic, local files) and the per-step batch plan."""
