"""Users of `pie serve`: tokens are checked against stored hashes, key holders sign challenges,
and `pie auth` manages the users directory."""

from __future__ import annotations

import argparse
import json
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from pie.cli.auth import run_auth
from pie.cli.parser import add_auth_parser
from pie.server.auth import UserStore, default_users_dir
from pie.wire.challenge import AuthError, new_nonce, sign_nonce

pytestmark = pytest.mark.unit

# ssh-keygen -lf prints this for the Ed25519 key whose seed is 32 zero bytes.
ZERO_SEED_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDtqJ7zOtqQtYqOo0CpvDXNlMhV3HeJDpjrASKGLWdop"
ZERO_SEED_FINGERPRINT = "ssh-ed25519 SHA256:tAXFyTXI8xtDaujAEcwJslAYc9/6FKcUkd2Lw0xDhPo"

KEY_MAKERS = {
    "ed25519": ed25519.Ed25519PrivateKey.generate,
    "rsa-2048": lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
    "ecdsa-p256": lambda: ec.generate_private_key(ec.SECP256R1()),
}


def write_openssh_pair(directory: Path, name: str, key: object) -> tuple[Path, str]:
    """Writes `name` (private, OpenSSH format) and returns its path and the public line."""
    private = key.private_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    path = directory / name
    path.write_bytes(private)
    (directory / f"{name}.pub").write_bytes(public + b" someone@host\n")
    return path, public.decode() + " someone@host\n"


@pytest.fixture(scope="module", params=sorted(KEY_MAKERS))
def key_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("keys")
    return write_openssh_pair(directory, "id", KEY_MAKERS[request.param]())


@pytest.fixture
def store(tmp_path: Path) -> UserStore:
    return UserStore(tmp_path / "users")


# -- tokens -------------------------------------------------------------------------------------


def test_a_new_users_token_checks_out_and_a_wrong_one_does_not(store: UserStore) -> None:
    token = store.add("ada")
    assert token and store.check_token("ada", token)
    assert not store.check_token("ada", token + "x")
    assert "ada" in store


def test_an_unknown_or_malformed_user_fails_the_token_check_without_raising(
    store: UserStore,
) -> None:
    token = store.add("ada")
    assert token
    assert not store.check_token("bob", token)
    assert not store.check_token("../ada", token)
    assert "bob" not in store


def test_adding_again_replaces_the_token(store: UserStore) -> None:
    old = store.add("ada")
    new = store.add("ada")
    assert old and new and old != new
    assert store.check_token("ada", new)
    assert not store.check_token("ada", old)


def test_the_user_file_is_private_and_holds_only_the_token_hash(store: UserStore) -> None:
    token = store.add("ada")
    assert token
    path = store.directory / "ada.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    text = path.read_text()
    assert token not in text
    assert set(json.loads(text)) == {"name", "token_sha256", "public_keys"}
    assert [p.name for p in store.directory.iterdir()] == ["ada.json"]


def test_a_key_only_user_has_no_token_to_check(store: UserStore) -> None:
    assert store.add("ada", token=False, public_key=ZERO_SEED_KEY) is None
    assert not store.check_token("ada", "")
    assert not store.check_token("ada", "0" * 64)


def test_adding_nothing_is_refused(store: UserStore) -> None:
    with pytest.raises(AuthError, match="nothing to add"):
        store.add("ada", token=False)


# -- keys and challenges ------------------------------------------------------------------------


def test_a_signed_nonce_verifies_with_the_users_key(store: UserStore, key_pair) -> None:
    private_path, public_text = key_pair
    store.add("ada", token=False, public_key=public_text)
    nonce = new_nonce()
    assert store.verify_signature("ada", nonce, sign_nonce(private_path, nonce))


def test_a_signature_over_another_nonce_fails(store: UserStore, key_pair) -> None:
    private_path, public_text = key_pair
    store.add("ada", token=False, public_key=public_text)
    signature = sign_nonce(private_path, new_nonce())
    assert not store.verify_signature("ada", new_nonce(), signature)


def test_a_signature_by_another_users_key_fails(store: UserStore, key_pair, tmp_path: Path) -> None:
    private_path, public_text = key_pair
    other_path, other_public = write_openssh_pair(
        tmp_path, "other", ed25519.Ed25519PrivateKey.generate()
    )
    store.add("ada", token=False, public_key=public_text)
    store.add("bob", token=False, public_key=other_public)
    nonce = new_nonce()
    assert not store.verify_signature("ada", nonce, sign_nonce(other_path, nonce))
    assert not store.verify_signature("nobody", nonce, sign_nonce(private_path, nonce))


@pytest.mark.parametrize("garbage", ["", "!!!not base64!!!", "c2ln", "é", "AAAA="])
def test_garbage_signatures_fail_without_raising(store: UserStore, garbage: str) -> None:
    store.add("ada", public_key=ZERO_SEED_KEY)
    assert not store.verify_signature("ada", new_nonce(), garbage)


def test_a_pem_public_key_is_stored_as_one_openssh_line_once(store: UserStore) -> None:
    key = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key()
    pem = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()
    store.add("ada", token=False, public_key=pem)
    store.add("ada", token=False, public_key=ZERO_SEED_KEY + " ada@laptop")
    stored = json.loads((store.directory / "ada.json").read_text())
    assert stored["public_keys"] == [ZERO_SEED_KEY]


def test_list_shows_users_sorted_with_key_fingerprints(store: UserStore) -> None:
    store.add("zed")
    store.add("ada", token=False, public_key=ZERO_SEED_KEY)
    listed = store.list()
    assert [(u.name, u.has_token, u.keys) for u in listed] == [
        ("ada", False, (ZERO_SEED_FINGERPRINT,)),
        ("zed", True, ()),
    ]


def test_a_pem_private_key_signs_too(store: UserStore, tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    path = tmp_path / "key.pem"
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    store.add("ada", token=False, public_key=public.decode())
    nonce = new_nonce()
    assert store.verify_signature("ada", nonce, sign_nonce(path, nonce, password="pw"))
    with pytest.raises(AuthError, match="encrypted"):
        sign_nonce(path, nonce)


def test_an_unreadable_private_key_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(AuthError, match="cannot read private key"):
        sign_nonce(tmp_path / "missing", "n")
    (tmp_path / "id.pub").write_text(ZERO_SEED_KEY + "\n")
    with pytest.raises(AuthError, match="cannot load private key"):
        sign_nonce(tmp_path / "id.pub", "n")


# -- refusals and removal -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", ".hidden", "-dash", "a/b", "../x", "a b", "ada\n", "x" * 65])
def test_bad_user_names_are_refused_naming_the_rule(store: UserStore, name: str) -> None:
    with pytest.raises(AuthError, match="bad user name"):
        store.add(name)


def test_small_rsa_keys_and_other_text_are_refused(store: UserStore) -> None:
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key()
    line = small.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    with pytest.raises(AuthError, match="1024 bits"):
        store.add("ada", public_key=line.decode())
    with pytest.raises(AuthError, match="not a usable public key"):
        store.add("ada", public_key="hello there")
    assert "ada" not in store


def test_a_removed_user_no_longer_checks_out(store: UserStore) -> None:
    token = store.add("ada", public_key=ZERO_SEED_KEY)
    assert token
    store.remove("ada")
    assert not store.check_token("ada", token)
    assert "ada" not in store
    with pytest.raises(AuthError, match="no user 'ada'"):
        store.remove("ada")


def test_the_default_users_dir_follows_pie_config_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PIE_CONFIG_DIR", str(tmp_path))
    assert default_users_dir() == tmp_path / "users"
    monkeypatch.delenv("PIE_CONFIG_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_users_dir() == tmp_path / ".config" / "pie" / "users"


# -- pie auth -----------------------------------------------------------------------------------


def pie_auth(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pie")
    add_auth_parser(parser.add_subparsers(dest="command", required=True))
    return run_auth(parser.parse_args(["auth", *argv]))


def test_pie_auth_adds_lists_and_removes_users(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    users = str(tmp_path / "users")
    (tmp_path / "id.pub").write_text(ZERO_SEED_KEY + " ada@laptop\n")

    assert pie_auth("add", "ada", "--users-dir", users) == 0
    out, err = capsys.readouterr()
    token = out.strip()
    assert out == token + "\n" and "shown only once" in err
    assert UserStore(Path(users)).check_token("ada", token)

    bob = ("add", "bob", "--key", str(tmp_path / "id.pub"), "--no-token", "--users-dir", users)
    assert pie_auth(*bob) == 0
    assert capsys.readouterr().out == ""

    assert pie_auth("list", "--users-dir", users) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["user", "token", "keys"]
    assert lines[1].split() == ["ada", "yes", "-"]
    assert lines[2].split() == ["bob", "no", *ZERO_SEED_FINGERPRINT.split()]

    assert pie_auth("remove", "ada", "--users-dir", users) == 0
    assert [u.name for u in UserStore(Path(users)).list()] == ["bob"]


def test_pie_auth_reports_errors_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    users = str(tmp_path / "users")
    assert pie_auth("remove", "ghost", "--users-dir", users) == 2
    assert capsys.readouterr().err.startswith("pie auth: no user 'ghost'")
    assert pie_auth("add", "ada", "--key", str(tmp_path / "nope.pub"), "--users-dir", users) == 2
    assert "cannot read public key file" in capsys.readouterr().err
    assert pie_auth("add", "bad/name", "--users-dir", users) == 2
    assert "bad user name" in capsys.readouterr().err


# -- revocation ---------------------------------------------------------------------------------


def test_a_token_credential_holds_until_the_token_is_replaced(store: UserStore) -> None:
    token = store.add("ada")
    assert token
    credential = store.token_credential("ada", token)
    assert credential is not None and store.holds(credential)
    store.add("ada", public_key=ZERO_SEED_KEY, token=False)
    assert store.holds(credential)
    store.add("ada")
    assert not store.holds(credential)
    assert store.token_credential("ada", "wrong") is None


def test_a_key_credential_holds_until_its_key_or_user_is_gone(store: UserStore, key_pair) -> None:
    private_path, public_text = key_pair
    store.add("ada", token=False, public_key=public_text)
    nonce = new_nonce()
    credential = store.signature_credential("ada", nonce, sign_nonce(private_path, nonce))
    assert credential is not None and store.holds(credential)
    path = store.directory / "ada.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "public_keys": [ZERO_SEED_KEY]}))
    assert not store.holds(credential)
    path.write_text(json.dumps(record))
    assert store.holds(credential)
    store.remove("ada")
    assert not store.holds(credential)
