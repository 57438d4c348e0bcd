"""Signing keys: only Ed25519 keys are accepted, and a wrong one is refused when loaded, not at first use."""

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kvtrail.audit.chain import SignatureChecker, Signer, generate_keypair
from kvtrail.errors import ChainError


def test_ed25519_keys_sign_and_check(tmp_path):
    priv, pub = tmp_path / "k.pem", tmp_path / "k.pub"
    key_id = generate_keypair(priv, pub)
    signer, checker = Signer.from_file(priv), SignatureChecker(pub.read_bytes())
    assert signer.key_id == checker.key_id == key_id
    digest = b"\x01" * 32
    assert checker.check(digest, signer.sign(digest)) and not checker.check(b"\x02" * 32, signer.sign(digest))


def test_a_key_of_another_algorithm_is_refused_naming_it():
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    with pytest.raises(ChainError, match="signing key: an Ed25519 key is required, got "):
        Signer(pem)
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with pytest.raises(ChainError, match="public key: an Ed25519 key is required"):
        SignatureChecker(pub)


def test_garbage_and_missing_keys_are_chain_errors(tmp_path):
    with pytest.raises(ChainError, match="not a PEM private key"):
        Signer(b"nope")
    with pytest.raises(ChainError, match="not a PEM public key"):
        SignatureChecker(b"nope")
    with pytest.raises(ChainError, match="file not found"):
        Signer.from_file(tmp_path / "absent.pem")
