"""Drivers run batched forward passes on a model: torch only, no trio."""
