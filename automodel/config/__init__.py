"""Typed configuration: schemas (dataclasses) and the one boundary from composed YAML to them."""
