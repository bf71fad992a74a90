"""Trio actors: thin async shells around pure cores, connected by channels in pie/engine.py."""
