"""The CPU threads torch computes with: how many, and how they wait between parallel regions.

Importing this module does not load torch, so the wait policy can be set before torch is.
"""

from __future__ import annotations

import os
import sys

from pie.config import DriverConfig

WAIT_POLICY = "OMP_WAIT_POLICY"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def thread_count(config: DriverConfig) -> int:
    """`threads`, or for 0 the usable cores minus one, at least 1."""
    return config.threads or max(1, usable_cores() - 1)


def set_wait_policy(config: DriverConfig) -> None:
    """Puts `omp_wait_policy` in the environment unless the user set OMP_WAIT_POLICY there.

    OpenMP reads the variable once, when torch loads it, so once torch is imported this leaves
    the environment alone rather than claim a policy the process does not have.
    """
    if WAIT_POLICY not in os.environ and "torch" not in sys.modules:
        os.environ[WAIT_POLICY] = config.omp_wait_policy.upper()


def set_threads(config: DriverConfig) -> int:
    """Sets torch's intra-op (and, while it can still change, inter-op) thread count for the
    whole process; returns the intra-op count now in use."""
    import torch

    n = thread_count(config)
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        # Refused once inter-op work has started or the count was set before (a second
        # engine in one process): the pool keeps its size, which the driver hardly uses.
        pass
    return torch.get_num_threads()
