"""TLS checks on certificates made here: a CA and a leaf it signed pass; an expired certificate, a key
that is not the certificate's, and a leaf another CA signed fail; one expiring within 30 days warns."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from mcp2026.doctor.result import Status
from mcp2026.doctor.tls import check_tls_files, key_matches, verify_chain

NOW = dt.datetime.now(dt.timezone.utc)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_cert(cn, key, issuer_cn=None, issuer_key=None, days=(-1, 365), is_ca=False) -> x509.Certificate:
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(issuer_cn or cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW + dt.timedelta(days=days[0]))
        .not_valid_after(NOW + dt.timedelta(days=days[1]))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    return builder.sign(issuer_key or key, hashes.SHA256())


def new_key():
    return ec.generate_private_key(ec.SECP256R1())


def write(path: Path, *items) -> Path:
    data = b""
    for item in items:
        if isinstance(item, x509.Certificate):
            data += item.public_bytes(serialization.Encoding.PEM)
        else:
            data += item.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca_key, leaf_key, other_key = new_key(), new_key(), new_key()
    ca = make_cert("Test CA", ca_key, is_ca=True, days=(-1, 3650))
    leaf = make_cert("localhost", leaf_key, "Test CA", ca_key)
    other_ca = make_cert("Other CA", other_key, is_ca=True)
    return {
        "dir": d,
        "ca": write(d / "ca.pem", ca),
        "other_ca": write(d / "other_ca.pem", other_ca),
        "leaf": write(d / "leaf.pem", leaf),
        "leaf_key": write(d / "leaf.key", leaf_key),
        "other_key": write(d / "other.key", other_key),
        "ca_key": ca_key,
        "ca_cert": ca,
    }


def by_name(results):
    return {r.name: r for r in results}


def test_ca_signed_leaf_with_its_key_passes(pki):
    results = by_name(check_tls_files(pki["leaf"], pki["leaf_key"], pki["ca"]))
    assert {n: r.status for n, r in results.items()} == {
        "tls files": Status.PASS,
        "tls key": Status.PASS,
        "tls expiry": Status.PASS,
        "tls chain": Status.PASS,
    }, [r.reason for r in results.values()]
    assert "Test CA" in results["tls chain"].reason
    assert results["tls expiry"].details["days_left"] >= 360


def test_without_ca_bundle_the_chain_is_skipped(pki):
    results = by_name(check_tls_files(pki["leaf"], pki["leaf_key"], None))
    assert results["tls chain"].status is Status.SKIP


def test_expired_self_signed_certificate_fails(pki, tmp_path):
    key = new_key()
    cert = write(tmp_path / "old.pem", make_cert("old", key, days=(-400, -10)))
    results = by_name(check_tls_files(cert, write(tmp_path / "old.key", key), None))
    assert results["tls expiry"].status is Status.FAIL
    assert "expired on" in results["tls expiry"].reason
    assert results["tls key"].status is Status.PASS


def test_certificate_expiring_within_30_days_warns(pki, tmp_path):
    key = new_key()
    cert = write(tmp_path / "soon.pem", make_cert("soon", key, days=(-300, 10)))
    result = by_name(check_tls_files(cert, write(tmp_path / "soon.key", key), None))["tls expiry"]
    assert result.status is Status.WARN and "in 10 days" in result.reason


def test_a_key_that_is_not_the_certificates_fails(pki):
    result = by_name(check_tls_files(pki["leaf"], pki["other_key"], pki["ca"]))["tls key"]
    assert result.status is Status.FAIL and "does not belong" in result.reason


def test_a_leaf_not_signed_by_the_given_ca_fails(pki):
    result = by_name(check_tls_files(pki["leaf"], pki["leaf_key"], pki["other_ca"]))["tls chain"]
    assert result.status is Status.FAIL and "localhost" in result.reason


def test_a_forged_issuer_name_does_not_verify(pki, tmp_path):
    """Same issuer name as the CA, signed by another key: the signature check must catch it."""
    forger, key = new_key(), new_key()
    leaf = make_cert("localhost", key, "Test CA", forger)
    chain, problem = verify_chain([leaf], [pki["ca_cert"]])
    assert problem is not None and chain == [leaf]


def test_intermediates_in_the_certificate_file_complete_the_chain(pki, tmp_path):
    inter_key, leaf_key = new_key(), new_key()
    inter = make_cert("Intermediate", inter_key, "Test CA", pki["ca_key"], is_ca=True)
    leaf = make_cert("svc", leaf_key, "Intermediate", inter_key)
    certfile = write(tmp_path / "chain.pem", leaf, inter)
    results = by_name(check_tls_files(certfile, write(tmp_path / "svc.key", leaf_key), pki["ca"]))
    assert results["tls chain"].status is Status.PASS
    assert results["tls chain"].details["depth"] == 3
    alone = write(tmp_path / "alone.pem", leaf)  # without the intermediate the chain breaks
    results = by_name(check_tls_files(alone, write(tmp_path / "svc2.key", leaf_key), pki["ca"]))
    assert results["tls chain"].status is Status.FAIL


def test_unreadable_files_fail_with_the_path(tmp_path, pki):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    (result,) = check_tls_files(bad, pki["leaf_key"], None)
    assert result.status is Status.FAIL and str(bad) in result.reason
    (result,) = check_tls_files(pki["leaf"], tmp_path / "missing.key", None)
    assert result.status is Status.FAIL and "missing.key" in result.reason


def test_key_matches_compares_public_keys(pki):
    cert = x509.load_pem_x509_certificate(pki["leaf"].read_bytes())
    leaf_key = serialization.load_pem_private_key(pki["leaf_key"].read_bytes(), None)
    other = serialization.load_pem_private_key(pki["other_key"].read_bytes(), None)
    assert key_matches(cert, leaf_key) and not key_matches(cert, other)
