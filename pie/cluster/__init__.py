"""Joining other nodes: the SGLang router in front of their OpenAI endpoints (router.py)."""
