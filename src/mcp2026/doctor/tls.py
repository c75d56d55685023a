"""TLS checks of the files the server will load: certificate and key readable, the key belongs to the certificate, the
chain verifies against a CA bundle (issuer signatures, leaf to a CA, through intermediates in the
certificate file), and nothing in it is expired or about to expire."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from mcp2026.doctor.result import CheckResult, Status, failed, passed, skipped, warned

EXPIRY_WARNING = dt.timedelta(days=30)
MAX_CHAIN_DEPTH = 8


def load_certificates(path: Path) -> list[x509.Certificate]:
    """Every certificate in a PEM file, leaf first; ValueError when there is none."""
    data = path.read_bytes()
    try:
        certificates = x509.load_pem_x509_certificates(data)
    except ValueError as e:
        raise ValueError(f"{path}: not a PEM certificate ({e})") from None
    return certificates


def load_private_key(path: Path):
    try:
        return serialization.load_pem_private_key(path.read_bytes(), password=None)
    except TypeError:
        raise ValueError(
            f"{path}: the private key is encrypted; the server needs an unencrypted key"
        ) from None
    except ValueError as e:
        raise ValueError(f"{path}: not a PEM private key ({e})") from None


def _public_der(key) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def key_matches(certificate: x509.Certificate, private_key) -> bool:
    return _public_der(certificate.public_key()) == _public_der(private_key.public_key())


def not_after(certificate: x509.Certificate) -> dt.datetime:
    value = getattr(certificate, "not_valid_after_utc", None)  # cryptography >= 42
    return value if value is not None else certificate.not_valid_after.replace(tzinfo=dt.timezone.utc)


def not_before(certificate: x509.Certificate) -> dt.datetime:
    value = getattr(certificate, "not_valid_before_utc", None)
    return value if value is not None else certificate.not_valid_before.replace(tzinfo=dt.timezone.utc)


def subject(certificate: x509.Certificate) -> str:
    return certificate.subject.rfc4514_string() or "(empty subject)"


def _issued_by(certificate: x509.Certificate, issuer: x509.Certificate) -> bool:
    if certificate.issuer != issuer.subject:
        return False
    try:
        certificate.verify_directly_issued_by(issuer)
    except (InvalidSignature, ValueError, TypeError):  # bad signature, or a key type it cannot check
        return False
    return True


def verify_chain(
    chain: list[x509.Certificate], roots: list[x509.Certificate]
) -> tuple[list[x509.Certificate], str | None]:
    """Walk from the leaf (chain[0]) through intermediates in ``chain`` to a certificate in ``roots``.
    Returns (the path, leaf first, ending at the root; None) or (the path so far, why it stops)."""
    path = [chain[0]]
    for _ in range(MAX_CHAIN_DEPTH):
        current = path[-1]
        root = next((r for r in roots if _issued_by(current, r)), None)
        if root is not None:
            return (path if current == root else [*path, root]), None
        parent = next((c for c in chain[1:] if c not in path and _issued_by(current, c)), None)
        if parent is None:
            return path, (
                f"no certificate in the CA bundle or the certificate file signed {subject(current)!r} "
                f"(issuer {current.issuer.rfc4514_string()!r})"
            )
        path.append(parent)
    return path, f"the chain is longer than {MAX_CHAIN_DEPTH} certificates"


# ---- the checks ------------------------------------------------------------------------------------------
def _days(delta: dt.timedelta) -> str:
    return f"{delta.total_seconds() / 86400:.0f} days"


def check_tls_files(
    certfile: Path, keyfile: Path, ca_bundle: Path | None, now: dt.datetime | None = None
) -> list[CheckResult]:
    """Readable, matching, in date, and (with a CA bundle) chained to a trusted CA."""
    fix_files = "point ssl_certfile / ssl_keyfile at readable PEM files"
    try:
        chain = load_certificates(certfile)
        key = load_private_key(keyfile)
    except (OSError, ValueError) as e:
        return [failed("tls files", str(e), fix_files)]
    now = now or dt.datetime.now(dt.timezone.utc)
    leaf = chain[0]
    results = [
        passed(
            "tls files",
            f"{certfile}: {len(chain)} certificate(s), leaf {subject(leaf)}; {keyfile}: {type(key).__name__}",
            certificates=len(chain),
        )
    ]
    if key_matches(leaf, key):
        results.append(passed("tls key", "the private key belongs to the certificate"))
    else:
        results.append(
            failed(
                "tls key",
                f"{keyfile} does not belong to {certfile} (public keys differ)",
                "give the key the certificate was issued for",
            )
        )
    results.append(_check_dates(chain, now, "tls expiry"))
    if ca_bundle is None:
        results.append(skipped("tls chain", "give --ca-bundle CA.pem to verify the chain"))
        return results
    try:
        roots = load_certificates(ca_bundle)
    except (OSError, ValueError) as e:
        results.append(failed("tls chain", str(e), "give --ca-bundle a readable PEM file of CA certificates"))
        return results
    path, problem = verify_chain(chain, roots)
    if problem is not None:
        results.append(
            failed(
                "tls chain",
                f"does not verify against {ca_bundle}: {problem}",
                "use a certificate issued by that CA, or add the missing intermediates to the certificate file",
            )
        )
    else:
        dates = _check_dates(path[1:], now, "tls chain")
        if dates.status is not Status.PASS:
            results.append(dates)
        else:
            names = " <- ".join(subject(c) for c in reversed(path))
            results.append(passed("tls chain", f"verifies against {ca_bundle}: {names}", depth=len(path)))
    return results


def _check_dates(certificates, now: dt.datetime, name: str) -> CheckResult:
    fix = "renew the certificate"
    for c in certificates:
        if not_after(c) <= now:
            return failed(name, f"{subject(c)} expired on {not_after(c):%Y-%m-%d}", fix)
        if not_before(c) > now:
            return failed(name, f"{subject(c)} is not valid before {not_before(c):%Y-%m-%d %H:%M} UTC", fix)
    if not certificates:
        return passed(name, "no certificates to date-check")
    first = min(certificates, key=not_after)
    left = not_after(first) - now
    reason = f"{subject(first)} expires on {not_after(first):%Y-%m-%d} (in {_days(left)})"
    if left < EXPIRY_WARNING:
        return warned(name, reason, fix + f" within {_days(left)}", days_left=left.days)
    return passed(name, reason, days_left=left.days)
