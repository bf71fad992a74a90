"""The attack suite: hostile users and programs against a running engine or server."""
