"""pie: a programmable LLM serving engine."""

__version__ = "0.1.0"
