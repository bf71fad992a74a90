"""Named snapshots copied node to node over HTTP: the holder's route that reads a snapshot's KV
pages out through its driver (only for a caller that shows the cluster's node secret), and the
fetch on the other node, checked against the directory's hash chain and written into its own
free pages as if the snapshot had been saved there."""

from __future__ import annotations

import hmac
import json
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio
from attrs import frozen

from pie.actors.kv.pages import chain_hash
from pie.actors.kv.prefix import first_salt
from pie.actors.requester import RequestRefused
from pie.cluster.snapshots import SnapshotEntry
from pie.events import kv as ev
from pie.events.speculation import LeaseReleased
from pie.server.routes import Receive, Route, Scope, Send, refuse, respond

if TYPE_CHECKING:
    from pie.engine import Engine
    from pie.engine.stack import ModelStack

COPY_PATH = "/cluster/snapshot"
SECRET_HEADER = b"x-pie-node-secret"
MAGIC = b"PIESNAP1"
MAX_QUERY_BYTES = 4096


class CopyFailed(Exception):
    """A snapshot could not be copied; the message says why, in one line."""


@frozen(kw_only=True)
class Transfer:
    """What the holder sent: the snapshot's tokens, positions and every page's KV."""

    layout: str
    page_bytes: int
    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    data: bytes


def copy_route(engine: Engine, secret: str, max_bytes: int, serving: trio.CapacityLimiter) -> Route:
    """POST COPY_PATH {"model", "user", "name"}: the snapshot's KV pages, for another node;
    `serving` bounds how many are read out at once."""

    async def answer(scope: Scope, receive: Receive, send: Send, user: str | None) -> None:
        if not _shows(scope, secret):
            await refuse(send, 403, "this route serves the cluster's nodes only", "forbidden")
            return
        if scope["method"] != "POST" or scope["path"] != COPY_PATH:
            await refuse(send, 404, f"POST {COPY_PATH} only", "not_found")
            return
        try:
            model, owner, name = _query(await _body(receive))
            stack = engine.model(model)
        except (ValueError, KeyError) as err:
            await refuse(send, 400, str(err).strip("'\""), "invalid")
            return
        async with serving:
            status, body = await _lend(engine, stack, owner, name, max_bytes)
        kind = "application/octet-stream" if status == 200 else "application/json"
        await respond(send, status, body, kind)

    return Route(prefix=COPY_PATH, handler=answer, public=True)


async def _lend(
    engine: Engine, stack: ModelStack, user: str, name: str, max_bytes: int
) -> tuple[int, bytes]:
    """(status, body): the snapshot's pages read out while the kv actor keeps them pinned."""
    transfer = stack.page_transfer()
    if transfer is None:
        return _error(409, f"model {stack.name!r} on this node cannot read out KV pages")
    async with engine.requester(model=stack.name) as requester:
        try:
            lent = await requester.call(stack.kv_address, ev.LendSnapshot, user=user, name=name)
        except RequestRefused as err:
            return _error(404 if err.kind == "no_such_snapshot" else 409, err.message)
        try:
            if not lent.plain:
                return _error(409, f"snapshot {name!r} ran under adapters, masks or media")
            size = len(lent.pages) * transfer.page_bytes
            if size > max_bytes:
                return _error(413, f"snapshot {name!r} is {size} bytes of KV, over {max_bytes}")
            data = await trio.to_thread.run_sync(transfer.export_pages, lent.pages)
        finally:
            release = LeaseReleased(lease=lent.lease, context=0)
            engine.router.send_nowait(requester.address, stack.kv_address, release)
    header = {
        "layout": transfer.layout,
        "page_bytes": transfer.page_bytes,
        "tokens": list(lent.tokens),
        "positions": list(lent.positions),
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return 200, MAGIC + struct.pack(">I", len(head)) + head + data


async def fetch(
    http_url: str, secret: str, entry: SnapshotEntry, *, max_bytes: int, timeout: float
) -> Transfer:
    """The snapshot of `entry` from the node at `http_url`; CopyFailed on any refusal."""
    import httpx

    query = {"model": entry.model, "user": entry.user, "name": entry.name}
    headers = {SECRET_HEADER.decode(): secret}
    limit = max_bytes + (64 << 20)  # room for the token lists beside the pages
    try:
        async with (
            httpx.AsyncClient(timeout=timeout) as client,
            client.stream("POST", http_url + COPY_PATH, json=query, headers=headers) as reply,
        ):
            body = bytearray()
            async for chunk in reply.aiter_bytes():
                body += chunk
                if len(body) > limit:
                    raise CopyFailed(f"{entry.node} sent more than {limit} bytes")
    except httpx.HTTPError as exc:
        raise CopyFailed(f"fetching from {entry.node} at {http_url} failed: {exc}") from None
    if reply.status_code != 200:
        raise CopyFailed(f"{entry.node} refused the copy: {_message(bytes(body))}")
    return _parse(bytes(body), entry.node)


def check_chain(transfer: Transfer, entry: SnapshotEntry, scope: str, page_size: int) -> None:
    """The page hash chain the tokens make here equals the directory's; CopyFailed if not."""
    if len(transfer.tokens) != entry.tokens or len(transfer.positions) != entry.tokens:
        raise CopyFailed(f"{entry.node} sent {len(transfer.tokens)} tokens, not {entry.tokens}")
    salt = first_salt(scope, entry.user)
    previous, chain = b"", []
    for start in range(0, len(transfer.tokens) - page_size + 1, page_size):
        window = slice(start, start + page_size)
        previous = chain_hash(previous, transfer.tokens[window], transfer.positions[window], salt)
        chain.append(previous.hex())
    if tuple(chain) != entry.chain:
        raise CopyFailed(
            f"the tokens {entry.node} sent do not hash to the page chain the directory holds "
            f"for {entry.name!r}: refused"
        )


async def install(
    engine: Engine, stack: ModelStack, transfer: Transfer, entry: SnapshotEntry
) -> None:
    """Writes the transfer's pages into fresh pages of a context and saves it under the
    entry's name, as if it had been computed here (the user's snapshot quota applies)."""
    local = stack.page_transfer()
    if local is None:
        raise CopyFailed(f"model {stack.name!r} on this node cannot write KV pages")
    if local.layout != transfer.layout or local.page_bytes != transfer.page_bytes:
        theirs, ours = transfer.layout, local.layout
        raise CopyFailed(f"{entry.node} holds KV as {theirs!r}, this node as {ours!r}")
    async with engine.requester(model=stack.name) as requester:
        context = await requester.create_context(user=entry.user)
        placed = await _placed(requester, stack.kv_address, context, transfer)
        await _write(engine, requester.address, stack, local, placed, context, transfer)
        try:
            await requester.save(context, entry.name, user=entry.user)
        except RequestRefused as err:
            if err.kind != "snapshot_exists":  # another open copied it meanwhile
                raise CopyFailed(f"{err.kind}: {err.message}") from None


async def _placed(requester: Any, kv: str, context: int, transfer: Transfer) -> ev.PagesPlaced:
    try:
        placed: ev.PagesPlaced = await requester.call(
            kv,
            ev.ImportPages,
            context=context,
            tokens=transfer.tokens,
            positions=transfer.positions,
        )
    except RequestRefused as err:
        raise CopyFailed(f"{err.kind}: {err.message}") from None
    return placed


async def _write(
    engine: Engine,
    address: str,
    stack: ModelStack,
    local: Any,
    placed: ev.PagesPlaced,
    context: int,
    transfer: Transfer,
) -> None:
    """Writes the pages the prefix cache did not find; commits them, or rolls them back."""
    first = placed.kv_start // stack.info.page_size
    size = transfer.page_bytes
    ok = False
    try:
        await trio.to_thread.run_sync(
            local.import_pages, placed.pages[first:], transfer.data[first * size :]
        )
        ok = True
    finally:
        applied = ev.PassApplied(corr=placed.corr, context=context, ok=ok)
        engine.router.send_nowait(address, stack.kv_address, applied)


def _parse(body: bytes, node: str) -> Transfer:
    try:
        if not body.startswith(MAGIC):
            raise ValueError("not a snapshot transfer")
        (length,) = struct.unpack(">I", body[8:12])
        header = json.loads(body[12 : 12 + length])
        data = body[12 + length :]
        transfer = Transfer(
            layout=str(header["layout"]),
            page_bytes=int(header["page_bytes"]),
            tokens=_ints(header["tokens"]),
            positions=_ints(header["positions"]),
            data=data,
        )
        if transfer.page_bytes < 1 or len(data) % transfer.page_bytes:
            raise ValueError("the pages do not divide into whole pages")
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise CopyFailed(f"{node} sent a damaged snapshot ({exc})") from None
    return transfer


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError("tokens and positions must be lists of non-negative integers")
    return tuple(value)


def _shows(scope: Scope, secret: str) -> bool:
    shown = [value for name, value in scope["headers"] if name == SECRET_HEADER]
    return len(shown) == 1 and hmac.compare_digest(shown[0], secret.encode())


async def _body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if sum(map(len, parts)) > MAX_QUERY_BYTES:
            raise ValueError(f"the query is over {MAX_QUERY_BYTES} bytes")
        if not message.get("more_body", False):
            return b"".join(parts)


def _query(body: bytes) -> tuple[str, str, str]:
    try:
        query = json.loads(body)
    except ValueError:
        raise ValueError("the query is not JSON") from None
    fields: Sequence[Any] = (
        [query.get(k) for k in ("model", "user", "name")] if isinstance(query, dict) else []
    )
    if len(fields) != 3 or not all(isinstance(f, str) for f in fields):
        raise ValueError('the query must be {"model", "user", "name"}, each a string')
    return fields[0], fields[1], fields[2]


def _error(status: int, message: str) -> tuple[int, bytes]:
    error = {"message": message, "type": "refused", "param": None, "code": "refused"}
    return status, json.dumps({"error": error}).encode()


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace") or "no reason given"
