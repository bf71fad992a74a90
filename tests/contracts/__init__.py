"""Contract test classes that every implementation of an interface runs by subclassing."""

import pytest

pytest.register_assert_rewrite(
    *(
        f"{__name__}.{name}"
        for name in ("driver", "driver_sampling", "passes", "kv", "kv_churn", "kv_invariants")
    )
)
