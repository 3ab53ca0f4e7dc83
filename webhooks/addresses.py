"""Where a webhook may POST: public addresses only, unless IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS lists them.

A webhook URL is a request the workers make on a user's behalf; without a guard it reaches
whatever the workers can reach (the cloud's metadata service, Redis on 127.0.0.1:6379, the
private network) and the delivery log's status code and error make it a probe. So a host is
resolved and every address it resolves to is checked: loopback, private, link-local,
multicast, reserved, unspecified, shared (CGNAT), site-local and IPv6 addresses that embed
such an IPv4 address (IPv4-mapped, 6to4, Teredo, NAT64) are refused, and so are names of
metadata services and `localhost`, however they resolve. Networks listed in
IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS (CIDRs) are allowed, for receivers inside the network.

The check runs when a webhook is saved (REST and admin) and again before each attempt,
after resolution, and the attempt connects to the address that was checked (delivery.py),
so a name that resolves elsewhere a second later (DNS rebinding) changes nothing.

How it fails: a host that does not resolve at save time is accepted (the web server may not
see the workers' DNS) and fails its deliveries with "does not resolve"; a malformed
IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS raises ImproperlyConfigured (settings fail closed).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import SplitResult, urlsplit

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext as _

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Names refused whatever they resolve to: cloud metadata services and loopback names.
BLOCKED_NAMES = frozenset(
    {
        "localhost",
        "localhost.localdomain",
        "ip6-localhost",
        "ip6-loopback",
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "instance-data",
        "instance-data.ec2.internal",
    }
)
# NAT64 prefixes (RFC 6052, RFC 8215): the last 32 bits are an IPv4 address.
NAT64_NETWORKS = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


class AddressRefused(ValueError):
    """A webhook URL whose host is not a place deliveries may go; the message says why."""


class HostUnresolved(AddressRefused):
    """A webhook URL whose host does not resolve (now): a later attempt may do better."""


@dataclass(frozen=True)
class Target:
    """Where one attempt connects: the URL's parts and the checked address to connect to."""

    scheme: str
    host: str
    port: int
    path: str
    address: str


@lru_cache(maxsize=8)
def _networks_parse(raw: tuple[str, ...]) -> tuple[IPNetwork, ...]:
    networks = []
    for item in raw:
        try:
            networks.append(ipaddress.ip_network(item.strip(), strict=False))
        except ValueError as exc:
            raise ImproperlyConfigured(
                f"IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS: {item!r} is not a CIDR network ({exc})"
            ) from exc
    return tuple(networks)


def allowed_networks() -> tuple[IPNetwork, ...]:
    """IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS, parsed; raises ImproperlyConfigured on a bad entry."""
    raw = settings.IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS
    if isinstance(raw, str):
        raw = raw.split(",")
    return _networks_parse(tuple(item for item in raw if item.strip()))


def allowed_networks_check(app_configs=None, **kwargs) -> list[checks.Error]:
    """System check (every manage.py command, the worker's start): the allow-list parses."""
    try:
        allowed_networks()
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), id="webhooks.E001")]
    return []


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address a 6to4, Teredo or NAT64 address carries, if any."""
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if any(address in network for network in NAT64_NETWORKS):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _kind(address: IPAddress) -> str | None:
    """What makes an address not public (a word for the error), or None when it is public."""
    checks = (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
        ("site-local", isinstance(address, ipaddress.IPv6Address) and address.is_site_local),
        ("not globally routable", not address.is_global),
    )
    return next((word for word, hit in checks if hit), None)


def address_refusal(address: IPAddress, allowed: tuple[IPNetwork, ...] | None = None) -> str | None:
    """Why deliveries may not go to `address`, or None when they may.

    An IPv4-mapped IPv6 address is judged as the IPv4 address it maps; an address inside
    an allowed network is allowed whatever its kind."""
    allowed = allowed_networks() if allowed is None else allowed
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address.version == network.version and address in network for network in allowed):
        return None
    kind = _kind(address)
    if kind is None and isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None and _kind(embedded) is not None:
            kind = _("embeds %(address)s (%(kind)s)") % {"address": embedded, "kind": _kind(embedded)}
    if kind is None:
        return None
    return _(
        "%(address)s is %(kind)s; deliveries go to public addresses only "
        "(list internal receivers' networks in IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS)"
    ) % {"address": address, "kind": kind}


def _parts(url: str) -> tuple[SplitResult, str, int]:
    """The URL split, its host (lowercase, no trailing dot) and port; AddressRefused if none."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise AddressRefused(_("The URL's host or port is malformed: %(error)s") % {"error": exc}) from exc
    if parts.scheme.lower() not in ("http", "https"):
        raise AddressRefused(_("Enter an http:// or https:// URL."))
    if not host:
        raise AddressRefused(_("The URL has no host."))
    host = host.rstrip(".").lower()
    default = 443 if parts.scheme.lower() == "https" else 80
    return parts, host, port or default


def _name_refusal(host: str) -> str | None:
    if host in BLOCKED_NAMES or host.endswith(".localhost"):
        return _("%(host)s is a loopback or metadata-service name; webhooks may not use it") % {"host": host}
    return None


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None


def _resolve(host: str, port: int) -> list[IPAddress]:
    """Every address `host` resolves to, in the resolver's order; socket.gaierror if none."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses: list[IPAddress] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    return addresses


def url_check(url: str) -> None:
    """The save-time check: raises AddressRefused when the URL's host is a refused name, a
    refused address, or resolves to one. A host that does not resolve (yet) passes."""
    try:
        target_resolve(url)
    except HostUnresolved:
        return


def target_resolve(url: str) -> Target:
    """The delivery-time check: resolve the host now, refuse it if any address it resolves to
    is refused, and return the first address to connect to (pinned: no second lookup).

    How it fails: AddressRefused for a refused name or address; HostUnresolved (a kind of
    AddressRefused) for a host that does not resolve."""
    parts, host, port = _parts(url)
    refusal = _name_refusal(host)
    if refusal:
        raise AddressRefused(refusal)
    literal = _literal(host)
    try:
        addresses = [literal] if literal is not None else _resolve(host, port)
    except (OSError, UnicodeError) as exc:
        message = _("%(host)s does not resolve: %(error)s") % {"host": host, "error": exc}
        raise HostUnresolved(message) from exc
    if not addresses:
        raise HostUnresolved(_("%(host)s does not resolve") % {"host": host})
    for address in addresses:
        refusal = address_refusal(address)
        if refusal:
            raise AddressRefused(refusal)
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return Target(parts.scheme.lower(), host, port, path, str(addresses[0]))
