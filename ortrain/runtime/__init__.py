"""Executors that run exported graphs."""
