"""Replicas, the router and their backends (local processes or Ray)."""
