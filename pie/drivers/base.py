"""The Driver protocol every backend implements, and what a driver tells the engine about itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from attrs import frozen

from pie.drivers.batch import ForwardBatch
from pie.events.sampling import SlotOutput


@frozen(kw_only=True)
class DriverInfo:
    """Limits and facts the scheduler and kv actor plan with."""

    model_name: str
    vocab_size: int
    page_size: int
    num_pages: int
    max_batch_tokens: int
    max_batch_requests: int
    device: str
    dtype: str
    threads: int = 1
    """The CPU threads its kernels compute with (torch's intra-op pool for the torch driver)."""
    sliding_window: int | None = None
    """Set when every layer of the model attends only to this many most recent kv slots
    (Mistral): the kv actor then releases the pages that leave the window."""
    adapters: tuple[str, ...] = ()
    """The LoRA adapters loaded with the model, by name: a request may name one of them."""
    inputs: tuple[str, ...] = ("text",)
    """What the model reads: text, and the media its towers take (image, video, audio)."""
    outputs: tuple[str, ...] = ("text",)
    """What it produces: text, or speech too."""


class DriverError(Exception):
    """A batch the driver refused (bad indices, masks that do not add up, ...)."""


class Driver(Protocol):
    info: DriverInfo

    def forward(self, batch: ForwardBatch) -> list[SlotOutput]:
        """Runs one pass: page copies, then all tokens, then every sampling slot.

        Returns one output per sampling slot, in the batch's slot order.
        Raises DriverError for a malformed batch without changing any KV page.
        """
        ...


class PageTransfer(Protocol):
    """Whole KV pages read out as bytes and written back (a snapshot copied between nodes).
    Both sides must have the same `layout`; a page is `page_bytes` bytes."""

    layout: str
    page_bytes: int

    def export_pages(self, pages: Sequence[int]) -> bytes:
        """The pages' KV, page after page, in the order given."""
        ...

    def import_pages(self, pages: Sequence[int], data: bytes) -> None:
        """Writes `data` (as `export_pages` made it) into `pages`, which no pass uses now."""
        ...


def page_transfer(driver: object) -> PageTransfer | None:
    """The driver's page transfer, or None when it cannot read or write whole pages."""
    make = getattr(driver, "page_transfer", None)
    return make() if callable(make) else None
