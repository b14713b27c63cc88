"""What a failed connection of the Flower transport means, as a typed error with the fix.

gRPC reports a client without the server's CA, with another CA, or dialling a name the server's certificate
does not hold as ``UNAVAILABLE`` with the TLS library's text (``CERTIFICATE_VERIFY_FAILED``, ``Socket closed``,
…). :func:`transport_error` reads that report and returns a
:class:`~numpyro_pc.errors.TransportSecurityError` (TLS, authentication) or a
:class:`~numpyro_pc.errors.TransportError` (nothing listens, the connection was lost) whose message says what
was expected, what happened and which option to change. Needs no Flower (any exception with gRPC's
``code()``/``details()`` or none).
"""

from __future__ import annotations

from ..errors import TransportError, TransportSecurityError

__all__ = ["transport_error", "read_certificate"]

_CA_FIX = ("pass with --root-certificates the CA certificate that issued the server's certificate (the first "
           "file of the server's --certificates CA CERT KEY)")


def _status(err) -> tuple[str, str]:
    code = err.code() if callable(getattr(err, "code", None)) else None
    details = err.details() if callable(getattr(err, "details", None)) else None
    name = getattr(code, "name", None) or ("" if code is None else str(code))
    return name, str(details if details is not None else err)


def transport_error(err, address, tls, role="client") -> TransportError:
    """The typed error for a transport failure ``err`` (a ``grpc.RpcError`` or any exception) at ``address``.

    :param bool tls: whether this side used TLS (a client: it was given ``--root-certificates``).
    :param str role: ``"client"`` or ``"server"`` (whose options the fix names).
    :returns: a :class:`~numpyro_pc.errors.TransportSecurityError` for a TLS or authentication failure, else a
        :class:`~numpyro_pc.errors.TransportError`; ``details`` holds gRPC's own report.
    """
    code, details = _status(err)
    found = f"gRPC reported {code or type(err).__name__}: {details}"
    low = details.lower()

    def security(what) -> TransportSecurityError:
        return TransportSecurityError(f"{what} ({found})", address=address, details=details)

    if code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return security(f"the server at {address} refused this {role}'s credentials: it authenticates its peers and "
                        "does not know this one; use the credentials (key, certificate) the server was given for it")
    if "peer name" in low or "not in peer certificate" in low or "hostname" in low and "mismatch" in low:
        return security(f"the server's certificate does not name {address.rsplit(':', 1)[0]!r}, the host this "
                        f"client dials: issue the certificate with that name in its subjectAltName, or dial a name "
                        f"it holds")
    if "certificate_verify_failed" in low or "certificate verify failed" in low or "unable to get local issuer" in low:
        return security(f"the TLS handshake with {address} failed: the server's certificate is not signed by the CA "
                        f"this client trusts; {_CA_FIX}")
    if "wrong_version_number" in low and tls:
        return security(f"the TLS handshake with {address} failed: the server does not speak TLS; start it with "
                        f"--certificates CA CERT KEY, or (loopback or a trusted network only) drop "
                        f"--root-certificates")
    if any(s in low for s in ("handshake", "ssl", "tsi_", "tls")):
        return security(f"the TLS handshake with {address} failed; check that the client's --root-certificates is "
                        f"the CA of the server's certificate and that the certificate is valid now")
    if "socket closed" in low and not tls:
        return security(f"the server at {address} closed the connection of this plain (insecure) client before any "
                        f"message: it expects TLS; {_CA_FIX}")
    if "stream removed" in low or "connection reset" in low or code == "CANCELLED":
        return TransportError(f"the connection to the server at {address} was lost during the run: the server "
                              f"stopped or failed (see its log and its --out file) ({found})", address=address,
                              details=details)
    if "connection refused" in low or "failed to connect" in low or code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        return TransportError(f"no server answered at {address}: start the server first, check the address and "
                              f"port, or raise --max-wait ({found})", address=address, details=details)
    return TransportError(f"the connection to {address} failed ({found})", address=address, details=details)


def read_certificate(path, option) -> bytes:
    """The bytes of a certificate or key file given to ``option``.

    :raises TransportSecurityError: the file cannot be read or holds no PEM block.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as err:
        raise TransportSecurityError(f"{option}: cannot read {path!r} ({err.strerror or err}); expected a PEM "
                                     f"file (a certificate or key made e.g. by openssl)") from err
    if b"-----BEGIN" not in data:
        raise TransportSecurityError(f"{option}: {path!r} holds no PEM block ('-----BEGIN …'); expected a "
                                     f"PEM-encoded certificate or key")
    return data
