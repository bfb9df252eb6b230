"""The data sources (``registry.py``: one registered object per ``data=<name>``), the rows they
make (``sources.py``), and the per-step batch plan."""
