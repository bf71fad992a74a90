"""Joining other pie nodes through Redis (docs/scale-out.md). Only a node started with [cluster]
redis set imports this package's Redis side (store.py, and coredis with it)."""
