"""The kv actor: contexts as chains of refcounted, content-addressed KV pages."""

from pie.actors.kv.core import KvCore, KvStatistics
from pie.actors.kv.pages import OutOfPages, PagePool
from pie.actors.kv.quotas import Quotas

__all__ = ["KvCore", "KvStatistics", "OutOfPages", "PagePool", "Quotas"]
