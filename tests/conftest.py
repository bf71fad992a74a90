"""Test plumbing: `async def` tests run under trio.run (trio's own test helper)."""

from __future__ import annotations

import inspect

import pytest
import trio.testing

from tests.model_fixtures import (  # noqa: F401  (fixtures for every module)
    default_model_dir,
    real,
    tokenizer,
)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    trio.testing.trio_test(pyfuncitem.obj)(**kwargs)
    return True
