"""Integrations of kvd with inference engines (each imports its engine only when used)."""
