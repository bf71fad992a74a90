"""`pie auth --cluster URL add|remove|list`: the users of a cluster, kept in its Redis, which
every node of the cluster follows (docs/scale-out.md#users)."""

from __future__ import annotations

import argparse
import sys

import trio

from pie.cli.auth import print_users, read_key, report_added
from pie.cluster.store import STORE_ERRORS, open_store, redacted, redis_down
from pie.cluster.users import SharedUsers
from pie.config import EngineConfig, with_overrides
from pie.config.cluster_section import redis_url_problem
from pie.server.shared_users import add_user, list_users, remove_user
from pie.wire.challenge import AuthError


def run_cluster_auth(args: argparse.Namespace) -> int:
    """One `pie auth` action on the cluster; 0 on success, 2 with one line on stderr."""
    url = args.cluster
    try:
        problem = redis_url_problem(url)
        if problem is not None:
            raise AuthError(problem)
        trio.run(_act, args)
    except AuthError as exc:
        print(f"pie auth: {exc}", file=sys.stderr)
        return 2
    return 0


async def _act(args: argparse.Namespace) -> None:
    keys = with_overrides(EngineConfig(), cluster={"redis": args.cluster}).cluster
    failure: BaseException | None = None
    async with open_store(keys.redis, keys.connect_timeout_seconds) as store:
        shared = SharedUsers(store, max_users=keys.max_users)
        try:
            await _one(shared, args)
        except STORE_ERRORS as exc:
            failure = exc
        except AuthError as exc:
            failure = exc
    if isinstance(failure, AuthError):
        raise AuthError(str(failure)) from None
    if failure is not None:
        raise AuthError(redis_down(keys.redis, failure)) from None


async def _one(shared: SharedUsers, args: argparse.Namespace) -> None:
    where = redacted(shared.store.url)
    if args.auth_command == "add":
        public_key = read_key(args.key) if args.key is not None else None
        token = await add_user(shared, args.user, token=not args.no_token, public_key=public_key)
        report_added(args.user, args.key, token)
    elif args.auth_command == "remove":
        await remove_user(shared, args.user)
        print(f"removed user {args.user} from the cluster at {where}", file=sys.stderr)
    elif args.auth_command == "list":
        print_users(await list_users(shared))
    else:
        raise AuthError(f"unknown action {args.auth_command!r}: use add, remove or list")
