"""Users of the WebSocket server and how they prove who they are: hashed tokens and public keys
kept one JSON file per user, challenge signing and checking. See docs/auth.md.
"""

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
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

_NAME_RULE = "1-64 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_MIN_RSA_BITS = 2048
_EC_CURVES = (ec.SECP256R1, ec.SECP384R1, ec.SECP521R1)
# Compared against when a user has no token, so a miss costs about as much as a wrong token.
_NO_TOKEN = "0" * 64

PublicKey = ed25519.Ed25519PublicKey | rsa.RSAPublicKey | ec.EllipticCurvePublicKey


class AuthError(ValueError):
    """A user, key or users directory that cannot be used; the message says why."""


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


def new_nonce() -> str:
    """A fresh challenge for `RequestChallenge`."""
    return secrets.token_urlsafe(32)


def _hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise AuthError(f"bad user name {name!r}: use {_NAME_RULE}")
    return name


# -- public keys --------------------------------------------------------------------------------


def _checked_public(key: object) -> PublicKey:
    if isinstance(key, ed25519.Ed25519PublicKey):
        return key
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size < _MIN_RSA_BITS:
            raise AuthError(f"RSA key of {key.key_size} bits: at least {_MIN_RSA_BITS} needed")
        return key
    if isinstance(key, ec.EllipticCurvePublicKey):
        if not isinstance(key.curve, _EC_CURVES):
            raise AuthError(f"ECDSA curve {key.curve.name} unsupported: use P-256, P-384 or P-521")
        return key
    raise AuthError(f"unsupported key type {type(key).__name__}: use Ed25519, RSA or ECDSA")


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
    public = _checked_public(key)
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


def _verify(key_line: str, data: bytes, signature: bytes) -> bool:
    try:
        key = _checked_public(serialization.load_ssh_public_key(key_line.encode()))
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        else:
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError, UnsupportedAlgorithm):
        return False
    return True


# -- the client's side of a challenge -----------------------------------------------------------


def _load_private(data: bytes, password: bytes | None) -> object:
    if b"BEGIN OPENSSH PRIVATE KEY" in data:
        return serialization.load_ssh_private_key(data, password)
    return serialization.load_pem_private_key(data, password)


def sign_nonce(private_key_path: Path, nonce: str, password: str | None = None) -> str:
    """The base64 signature of `nonce` that `UserStore.verify_signature` accepts."""
    path = Path(private_key_path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise AuthError(f"cannot read private key {path}: {exc.strerror or exc}") from exc
    secret = password.encode() if password is not None else None
    try:
        key = _load_private(data, secret)
    except TypeError as exc:
        raise AuthError(f"private key {path} is encrypted: give its password") from exc
    except UnsupportedAlgorithm as exc:
        # Encrypted OpenSSH keys need bcrypt's KDF, which is not installed.
        raise AuthError(f"cannot load private key {path}: {exc}") from exc
    except ValueError as exc:
        raise AuthError(f"cannot load private key {path}: {exc}") from exc
    return base64.b64encode(_sign(key, nonce.encode(), path)).decode()


def _sign(key: object, data: bytes, path: Path) -> bytes:
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    raise AuthError(f"private key {path} is {type(key).__name__}: use Ed25519, RSA or ECDSA")


# -- the store ----------------------------------------------------------------------------------


class UserStore:
    """One `<name>.json` per user in `directory`; every call reads the files afresh, so edits by
    `pie auth` reach a running server."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def _path(self, name: str) -> Path:
        return self.directory / f"{_check_name(name)}.json"

    def _read(self, name: str) -> dict[str, Any] | None:
        path = self._path(name)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise AuthError(f"cannot read user file {path}: {exc}") from exc
        token = raw.get("token_sha256") if isinstance(raw, dict) else None
        keys = raw.get("public_keys") if isinstance(raw, dict) else None
        if (
            not isinstance(raw, dict)
            or not (token is None or isinstance(token, str))
            or not isinstance(keys, list)
            or not all(isinstance(k, str) for k in keys)
        ):
            raise AuthError(f"user file {path} is not a user record")
        return {"name": name, "token_sha256": token, "public_keys": list(keys)}

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
        _check_name(name)
        if not token and public_key is None:
            raise AuthError(f"nothing to add to user {name!r}: give a public key or a token")
        key_line = parse_public_key(public_key) if public_key is not None else None
        record = self._read(name) or {"name": name, "token_sha256": None, "public_keys": []}
        new_token = secrets.token_urlsafe(32) if token else None
        if new_token is not None:
            record["token_sha256"] = _hash_token(new_token)
        if key_line is not None and key_line not in record["public_keys"]:
            record["public_keys"].append(key_line)
        self._write(record)
        return new_token

    def remove(self, name: str) -> None:
        """Deletes the user; AuthError when there is none by that name."""
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            raise AuthError(f"no user {name!r} in {self.directory}") from None

    def list(self) -> list[UserRecord]:
        """Every user, sorted by name."""
        if not self.directory.is_dir():
            return []
        names = sorted(p.stem for p in self.directory.glob("*.json") if _NAME_RE.fullmatch(p.stem))
        return [self._record(name) for name in names]

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
        record = self._lookup(name) if isinstance(name, str) else None
        stored = record["token_sha256"] if record else None
        try:
            offered = _hash_token(token)
        except (AttributeError, UnicodeEncodeError):
            return False
        return hmac.compare_digest(stored or _NO_TOKEN, offered) and stored is not None

    def verify_signature(self, name: str, nonce: str, signature_b64: str) -> bool:
        """Whether one of `name`'s keys signed `nonce`; False, never an exception, otherwise."""
        record = self._lookup(name) if isinstance(name, str) else None
        if record is None:
            return False
        try:
            data = nonce.encode()
            signature = base64.b64decode(signature_b64, validate=True)
        except (AttributeError, TypeError, ValueError):
            return False
        return any(_verify(line, data, signature) for line in record["public_keys"])
