"""Building models and finding their parts (blocks, layer groups). No parallelism here."""
