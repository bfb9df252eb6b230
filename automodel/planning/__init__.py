"""Planning a layout before launching it: memory, communication and time per rank, for any
world size, on one CPU process (``plan.py``; docs/planning.md)."""
