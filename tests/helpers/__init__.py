"""Shared test helpers: 2-rank gloo runner, the settings table, skip markers."""
