"""Validators shared by the config sections: each raises ValueError in words a user reads."""

from __future__ import annotations

from typing import Any

import attrs


def choice(*allowed: str) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in allowed and not (attribute.name == "device" and value.startswith("cuda:")):
            raise ValueError(f"{attribute.name} must be one of {', '.join(allowed)}, got {value!r}")

    return check


def at_least(n: int) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: int) -> None:
        if value < n:
            raise ValueError(f"{attribute.name} must be >= {n}, got {value}")

    return check


def at_most(n: int) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: int) -> None:
        if value > n:
            raise ValueError(f"{attribute.name} must be <= {n}, got {value}")

    return check


def share(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value}")


def positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")
