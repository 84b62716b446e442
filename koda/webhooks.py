"""Webhooks, the pure part: URL rules, secrets, Standard Webhooks signatures, backoff.

No I/O except :func:`resolve_checked` (a DNS lookup); the gateway checks a URL at
creation with :func:`check_url`, the dispatcher (processors/webhooks.py) checks it
again at every attempt, and checks every address the name resolves to then (DNS
rebinding: a name that pointed at a public address at creation may point inside later).

The URL rule: ``https``, or ``http`` in dev; a host name or address; no user
name or password; at most :data:`MAX_URL_CHARS`. Addresses that are loopback, private
(RFC 1918, unique local), link-local (cloud metadata at 169.254.169.254), multicast,
reserved or unspecified are refused in prod unless ``KODA_WEBHOOK_ALLOW_PRIVATE=true``,
and allowed in dev unless ``KODA_WEBHOOK_ALLOW_PRIVATE=false``.

Signatures follow Standard Webhooks (https://www.standardwebhooks.com): the signed
content is ``{webhook-id}.{webhook-timestamp}.{body}``, HMAC-SHA256 keyed with the
base64-decoded part of the secret after ``whsec_``, sent as ``webhook-signature:
v1,<base64>``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import random
import secrets
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from koda_runtime.errors import KodaError
from koda_runtime.naming import AppEnv
from koda_runtime.settings import Settings

SECRET_PREFIX = "whsec_"  # noqa: S105 - the prefix of every secret, not one
SECRET_BYTES = 32
MAX_URL_CHARS = 2048
URL_RULE = (
    "an absolute https:// URL (http:// only in dev) with a host name or address, no "
    "user name or password, at most 2048 characters"
)
PRIVATE_RULE = (
    "loopback, private, link-local and other non-public addresses are refused "
    "(KODA_WEBHOOK_ALLOW_PRIVATE=true allows them)"
)


class WebhookUrlRefused(KodaError):
    """A webhook URL breaks the URL rule or points at a refused address."""

    def __init__(self, message: str, *, rule: str) -> None:
        super().__init__(message)
        self.message = message
        # "url": the shape of the URL; "address": where it points.
        self.rule = rule


@dataclass(frozen=True)
class UrlPolicy:
    """What a webhook URL may be: ``http`` allowed (dev), non-public addresses allowed."""

    allow_http: bool
    allow_private: bool

    @classmethod
    def of(cls, settings: Settings) -> UrlPolicy:
        """dev: http and non-public addresses allowed; prod: neither, unless
        ``KODA_WEBHOOK_ALLOW_PRIVATE=true`` (which allows the addresses, never http).
        ``KODA_WEBHOOK_ALLOW_PRIVATE=false`` refuses them in dev too."""
        dev = settings.app_env is AppEnv.DEV
        allow = settings.webhook_allow_private
        return cls(allow_http=dev, allow_private=dev if allow is None else allow)


def new_secret() -> str:
    """A fresh signing secret: ``whsec_`` and 32 random bytes in base64."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def _key(secret: str) -> bytes:
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError("a webhook secret starts with whsec_")
    return base64.b64decode(secret[len(SECRET_PREFIX) :])


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value: ``v1,<base64 HMAC-SHA256>`` of
    ``{msg_id}.{timestamp}.{body}``."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(_key(secret), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify(secret: str, msg_id: str, timestamp: int, body: bytes, header: str) -> bool:
    """True when one of the space-separated signatures of ``header`` is ours (a
    receiver's check, kept here for the tests and the README's example)."""
    expected = sign(secret, msg_id, timestamp, body)
    return any(hmac.compare_digest(expected, sig) for sig in header.split())


def address_refused(address: str) -> bool:
    """True for an address a webhook may not reach without KODA_WEBHOOK_ALLOW_PRIVATE."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (
        ip.is_loopback
        or ip.is_private
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or not ip.is_global
    )


def _literal_ip(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


def check_url(url: object, policy: UrlPolicy) -> str:
    """``url`` when it meets the URL rule and, if it is a literal address (or
    ``localhost``), the address rule; WebhookUrlRefused naming the broken rule else.
    A host name's addresses are checked at each delivery (:func:`resolve_checked`)."""
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
        raise WebhookUrlRefused(f"url must be {URL_RULE}", rule="url")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise WebhookUrlRefused(f"url must be {URL_RULE}", rule="url") from None
    schemes = ("https", "http") if policy.allow_http else ("https",)
    if parts.scheme not in schemes:
        allowed = "https" if not policy.allow_http else "https or http"
        raise WebhookUrlRefused(
            f"url must use {allowed} (http:// is refused in prod): {URL_RULE}", rule="url"
        )
    host = parts.hostname
    if not host or parts.username is not None or parts.password is not None or port == 0:
        raise WebhookUrlRefused(f"url must be {URL_RULE}", rule="url")
    if any(c.isspace() for c in url):
        raise WebhookUrlRefused(f"url must be {URL_RULE} (no spaces)", rule="url")
    literal = _literal_ip(host)
    if not policy.allow_private and (
        host == "localhost"
        or host.endswith(".localhost")
        or (literal is not None and address_refused(literal))
    ):
        raise WebhookUrlRefused(
            f"url points at {host}, a non-public address: {PRIVATE_RULE}", rule="address"
        )
    return url


def resolve_checked(host: str, port: int, policy: UrlPolicy) -> list[str]:
    """Every address ``host`` resolves to now; WebhookUrlRefused if any is refused
    (a name with one private address among public ones is refused as a whole)."""
    literal = _literal_ip(host)
    if literal is not None:
        addresses = [literal]
    else:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not policy.allow_private:
        for address in addresses:
            if address_refused(address):
                raise WebhookUrlRefused(
                    f"{host} resolves to {address}, a non-public address: {PRIVATE_RULE}",
                    rule="address",
                )
    return addresses


def retry_delay(
    attempt: int, first_s: float, max_s: float, rand: random.Random | None = None
) -> float:
    """Seconds before the next try after failed attempt ``attempt`` (1-based):
    ``first_s * 2**(attempt-1)``, capped at ``max_s``, drawn in [half, whole] of it
    (jitter: receivers that come back are not hit by every dispatcher at once)."""
    base = min(max_s, first_s * 2.0 ** min(attempt - 1, 60))
    draw: float = (rand or random).uniform(0.5, 1.0)
    return base * draw
