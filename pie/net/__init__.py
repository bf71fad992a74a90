"""Outgoing network access for inferlets: the policy and the HTTP client."""
