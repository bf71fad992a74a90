"""The challenge format both ends of an authenticated connection share: the server's nonce, the
client's signature of it with a private key, and the check of that signature against a public
key (Ed25519, RSA of 2048 bits or more with PKCS#1 v1.5, or ECDSA on P-256/384/521; SHA-256)."""

from __future__ import annotations

import base64
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

_MIN_RSA_BITS = 2048
_EC_CURVES = (ec.SECP256R1, ec.SECP384R1, ec.SECP521R1)

PublicKey = ed25519.Ed25519PublicKey | rsa.RSAPublicKey | ec.EllipticCurvePublicKey


class AuthError(ValueError):
    """A user, key or users directory that cannot be used; the message says why."""


def new_nonce() -> str:
    """A fresh challenge for `RequestChallenge`."""
    return secrets.token_urlsafe(32)


def checked_public_key(key: object) -> PublicKey:
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


def verify_signature(key_line: str, data: bytes, signature: bytes) -> bool:
    try:
        key = checked_public_key(serialization.load_ssh_public_key(key_line.encode()))
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        else:
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError, UnsupportedAlgorithm):
        return False
    return True


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
