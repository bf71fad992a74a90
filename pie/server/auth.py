"""Users of the WebSocket server: hashed tokens and public keys kept one JSON file per user, and
the checks of what a connecting client offers (the challenge format is in pie/wire). See
docs/auth.md."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
from pathlib import Path
from typing import Any

from attrs import frozen
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from pie.wire.challenge import AuthError, checked_public_key, verify_signature

_NAME_RULE = "1-64 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# Compared against when a user has no token, so a miss costs about as much as a wrong token.
_NO_TOKEN = "0" * 64


@frozen(kw_only=True)
class UserRecord:
    """What `pie auth list` shows of one user: never the token hash, only whether there is one."""

    name: str
    has_token: bool
    keys: tuple[str, ...]


def default_users_dir() -> Path:
    """`$PIE_CONFIG_DIR/users`, else `~/.config/pie/users`."""
    base = os.environ.get("PIE_CONFIG_DIR")
    root = Path(base) if base else Path.home() / ".config" / "pie"
    return root / "users"


def _hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise AuthError(f"bad user name {name!r}: use {_NAME_RULE}")
    return name


def parse_public_key(text: str) -> str:
    """An OpenSSH one-line or PEM public key, as an OpenSSH line without comment."""
    data = text.strip().encode()
    try:
        if data.startswith(b"-----BEGIN"):
            key = serialization.load_pem_public_key(data)
        else:
            key = serialization.load_ssh_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise AuthError(f"not a usable public key: {exc}") from exc
    public = checked_public_key(key)
    line = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return line.decode()


def fingerprint(key_line: str) -> str:
    """`ssh-ed25519 SHA256:…` as `ssh-keygen -l` prints it."""
    kind, _, rest = key_line.partition(" ")
    try:
        blob = base64.b64decode(rest.split()[0], validate=True)
    except (IndexError, ValueError) as exc:
        raise AuthError(f"malformed OpenSSH public key line {key_line!r}") from exc
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    return f"{kind} SHA256:{digest}"


@frozen(kw_only=True)
class Credential:
    """What a connection or request proved: `user`'s token (by its hash) or one of its keys.
    Held while the connection lives so that revoking it can be noticed (`UserStore.holds`)."""

    user: str
    token_sha256: str | None = None
    key: str | None = None


# -- records ------------------------------------------------------------------------------------


def parse_record(name: str, text: str, where: str) -> dict[str, Any]:
    """A user record read from `where` (a file, or the cluster), checked; AuthError if bad."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise AuthError(f"cannot read user record {where}: {exc}") from exc
    token = raw.get("token_sha256") if isinstance(raw, dict) else None
    keys = raw.get("public_keys") if isinstance(raw, dict) else None
    if (
        not isinstance(raw, dict)
        or not (token is None or isinstance(token, str))
        or not isinstance(keys, list)
        or not all(isinstance(k, str) for k in keys)
    ):
        raise AuthError(f"user record {where} is not a user record")
    return {"name": name, "token_sha256": token, "public_keys": list(keys)}


def updated_record(
    name: str, record: dict[str, Any] | None, *, token: bool, public_key: str | None
) -> tuple[dict[str, Any], str | None]:
    """`record` (None: a new user) with a new token and/or `public_key` added, and the new
    token (shown once) or None."""
    _check_name(name)
    if not token and public_key is None:
        raise AuthError(f"nothing to add to user {name!r}: give a public key or a token")
    key_line = parse_public_key(public_key) if public_key is not None else None
    record = dict(record or {"name": name, "token_sha256": None, "public_keys": []})
    record["public_keys"] = list(record["public_keys"])
    new_token = secrets.token_urlsafe(32) if token else None
    if new_token is not None:
        record["token_sha256"] = _hash_token(new_token)
    if key_line is not None and key_line not in record["public_keys"]:
        record["public_keys"].append(key_line)
    return record, new_token


# -- the checks, over any source of records ----------------------------------------------------


class UserChecks:
    """What a connecting client offers, checked against the records `_read` finds."""

    def _read(self, name: str) -> dict[str, Any] | None:
        raise NotImplementedError

    def names(self) -> set[str]:
        raise NotImplementedError

    def list(self) -> list[UserRecord]:
        """Every user, sorted by name."""
        return [self._record(name) for name in sorted(self.names())]

    def _record(self, name: str) -> UserRecord:
        raw = self._read(name)
        if raw is None:
            raise AuthError(f"user file for {name!r} vanished while listing")
        keys = tuple(fingerprint(k) for k in raw["public_keys"])
        return UserRecord(name=name, has_token=raw["token_sha256"] is not None, keys=keys)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._lookup(name) is not None

    def _lookup(self, name: str) -> dict[str, Any] | None:
        """The user's record, or None for unknown, invalid or unreadable users."""
        try:
            return self._read(name)
        except AuthError:
            return None

    def check_token(self, name: str, token: str) -> bool:
        """Whether `token` is `name`'s; False, never an exception, for unknown users."""
        return self.token_credential(name, token) is not None

    def token_credential(self, name: str, token: str) -> Credential | None:
        """The credential `token` proves for `name`, or None (never an exception)."""
        record = self._lookup(name) if isinstance(name, str) else None
        stored = record["token_sha256"] if record else None
        try:
            offered = _hash_token(token)
        except (AttributeError, UnicodeEncodeError):
            return None
        if hmac.compare_digest(stored or _NO_TOKEN, offered) and stored is not None:
            return Credential(user=name, token_sha256=offered)
        return None

    def verify_signature(self, name: str, nonce: str, signature_b64: str) -> bool:
        """Whether one of `name`'s keys signed `nonce`; False, never an exception, otherwise."""
        return self.signature_credential(name, nonce, signature_b64) is not None

    def signature_credential(self, name: str, nonce: str, signature_b64: str) -> Credential | None:
        """The credential (the key) that signed `nonce` for `name`, or None."""
        record = self._lookup(name) if isinstance(name, str) else None
        if record is None:
            return None
        try:
            data = nonce.encode()
            signature = base64.b64decode(signature_b64, validate=True)
        except (AttributeError, TypeError, ValueError):
            return None
        for line in record["public_keys"]:
            if verify_signature(line, data, signature):
                return Credential(user=name, key=line)
        return None

    def holds(self, credential: Credential) -> bool:
        """Whether `credential` still lets its user in: False once the user is removed, its
        token replaced or the key taken away (an unreadable user file counts as revoked)."""
        record = self._lookup(credential.user)
        if record is None:
            return False
        if credential.token_sha256 is not None:
            stored = record["token_sha256"] or _NO_TOKEN
            return hmac.compare_digest(stored, credential.token_sha256)
        return credential.key in record["public_keys"]


# -- the files ----------------------------------------------------------------------------------


class UserStore(UserChecks):
    """One `<name>.json` per user in `directory`; every call reads the files afresh, so edits by
    `pie auth` reach a running server."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def _path(self, name: str) -> Path:
        return self.directory / f"{_check_name(name)}.json"

    def _read(self, name: str) -> dict[str, Any] | None:
        path = self._path(name)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise AuthError(f"cannot read user file {path}: {exc}") from exc
        return parse_record(name, text, f"file {path}")

    def _write(self, record: dict[str, Any]) -> None:
        if not self.directory.exists():
            self.directory.mkdir(parents=True, mode=0o700)
            os.chmod(self.directory, 0o700)
        path = self._path(record["name"])
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{record['name']}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump(record, out, indent=2)
                out.write("\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def add(self, name: str, *, token: bool = True, public_key: str | None = None) -> str | None:
        """Creates or updates `name`; returns the new token (shown once), or None if none made."""
        record, new_token = updated_record(
            name, self._read(name), token=token, public_key=public_key
        )
        self._write(record)
        return new_token

    def remove(self, name: str) -> None:
        """Deletes the user; AuthError when there is none by that name."""
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            raise AuthError(f"no user {name!r} in {self.directory}") from None

    def names(self) -> set[str]:
        """The name of every user (files only listed, none read)."""
        if not self.directory.is_dir():
            return set()
        return {p.stem for p in self.directory.glob("*.json") if _NAME_RE.fullmatch(p.stem)}
