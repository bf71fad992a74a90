"""The kv actor: contexts as chains of refcounted, content-addressed KV pages."""

from pie.actors.kv.core import KvCore, KvStatistics
from pie.actors.kv.pages import OutOfPages, PagePool
from pie.actors.kv.quotas import Quotas
from pie.actors.kv.validation import OutputLimits

__all__ = ["KvCore", "KvStatistics", "OutOfPages", "OutputLimits", "PagePool", "Quotas"]
