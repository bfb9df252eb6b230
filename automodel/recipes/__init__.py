"""Recipes: what runs on every rank once the config is resolved."""
