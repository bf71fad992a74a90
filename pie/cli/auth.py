"""`pie auth add|remove|list`: manage the users that may connect to `pie serve`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pie.server.auth import UserRecord, UserStore


def run_auth(args: argparse.Namespace) -> int:
    """Runs one `pie auth` action; 0 on success, 2 with a message on stderr otherwise."""
    from pie.server.auth import UserStore, default_users_dir
    from pie.wire.challenge import AuthError

    if args.cluster:
        from pie.cli.cluster_auth import run_cluster_auth

        return run_cluster_auth(args)
    store = UserStore(Path(args.users_dir) if args.users_dir else default_users_dir())
    try:
        if args.auth_command == "add":
            _add(store, args.user, key_path=args.key, token=not args.no_token)
        elif args.auth_command == "remove":
            store.remove(args.user)
            print(f"removed user {args.user}", file=sys.stderr)
        elif args.auth_command == "list":
            _list(store)
        else:
            raise AuthError(f"unknown action {args.auth_command!r}: use add, remove or list")
    except AuthError as exc:
        print(f"pie auth: {exc}", file=sys.stderr)
        return 2
    return 0


def read_key(key_path: str) -> str:
    from pie.wire.challenge import AuthError

    try:
        return Path(key_path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthError(f"cannot read public key file {key_path}: {exc}") from exc


def _add(store: UserStore, user: str, *, key_path: str | None, token: bool) -> None:
    public_key = read_key(key_path) if key_path is not None else None
    new_token = store.add(user, token=token, public_key=public_key)
    report_added(user, key_path, new_token)


def report_added(user: str, key_path: str | None, new_token: str | None) -> None:
    if key_path is not None:
        print(f"user {user} accepts the key {key_path}", file=sys.stderr)
    if new_token is not None:
        print(new_token)
        print(f"the token of user {user}: keep it, it is shown only once", file=sys.stderr)


def _list(store: UserStore) -> None:
    print_users(store.list())


def print_users(records: list[UserRecord]) -> None:
    rows = [("user", "token", "keys")]
    for record in records:
        keys = ", ".join(record.keys) if record.keys else "-"
        rows.append((record.name, "yes" if record.has_token else "no", keys))
    width = max(len(row[0]) for row in rows)
    for name, has_token, keys in rows:
        print(f"{name:<{width}}  {has_token:<5}  {keys}")
