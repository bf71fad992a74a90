"""Building inferlets: a folder with main.py becomes a WebAssembly component (`pie build`)."""

from pie.build.check import BuildError, check_inferlet
from pie.build.component import SDK, build_inferlet, cached_build, inputs_digest

__all__ = ["SDK", "BuildError", "build_inferlet", "cached_build", "check_inferlet", "inputs_digest"]
