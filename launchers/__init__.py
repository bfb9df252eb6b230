"""Launch entry points. ``train.py`` is the Hydra CLI; these run composed configs directly."""
