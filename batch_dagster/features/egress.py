"""Where the service may send a request on a tenant's behalf: public addresses only, unless the operator's
allow-list (BATCH_WEBHOOK_ALLOW: hosts or CIDRs) opens an internal one. Pure: the resolver is passed in."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolve = Callable[[str, int], list[str]]  # (host, port) -> the addresses it resolves to

_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # well-known prefix: the last 32 bits are an IPv4 address


class Refused(ValueError):
    """A destination that is not public and not allowed; the message says which address and why."""


@dataclass(frozen=True)
class Allow:
    """The operator's allow-list: host names (exact, lowercase) and networks."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> Allow:
        """Each entry a CIDR, an address or a host name; raises ValueError for an entry that is none of them."""
        hosts, networks = set(), []
        for entry in (e.strip() for e in entries):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                if "/" in entry or not entry.replace("-", "").replace(".", "").replace("_", "").isalnum():
                    raise ValueError(f"BATCH_WEBHOOK_ALLOW: {entry!r} is neither a host nor a CIDR") from None
                hosts.add(_name(entry))
        return cls(frozenset(hosts), tuple(networks))

    def admits(self, address: Address) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # as it is judged in is_public
        return any(address.version == n.version and address in n for n in self.networks)


def _name(host: str) -> str:
    return host.strip("[]").rstrip(".").lower()


def numeric(host: str) -> Address | None:
    """The address a numeric host stands for, in every form a resolver takes: dotted, IPv6 (bracketed or not),
    and the classic inet_aton forms (2130706433, 0x7f.1, 0177.0.0.1, 127.1); None for a name."""
    host = _name(host)
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])  # an IPv6 zone (fe80::1%eth0) does not change the address
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def is_public(address: Address) -> bool:
    """Whether `address` is a public unicast one: not loopback, private, link-local (169.254.169.254, the cloud
    metadata service), shared, reserved, unspecified or multicast; IPv4 inside IPv6 (mapped, 6to4, NAT64) is
    judged by its IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = address.ipv4_mapped or address.sixtofour
        if inner is None and address in _NAT64:
            inner = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if inner is None and address.teredo is not None:
            inner = address.teredo[1]  # the client's address, obfuscated in the last 32 bits
        if inner is not None:
            return is_public(inner)
    return address.is_global and not (address.is_multicast or address.is_unspecified or address.is_reserved)


def resolve(host: str, port: int) -> list[str]:
    """The addresses the system resolver gives `host` (what a connection would use)."""
    return list(dict.fromkeys(str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))


def check(host: str, port: int, allow: Allow, resolver: Resolve | None = None) -> Address:
    """The address to connect to for `host`: resolved once, every address it resolves to public or allowed
    (a name with one internal address among public ones is refused, so no retry can land there). Raises Refused."""
    name = _name(host)
    address = numeric(name)
    if address is not None:
        addresses = [address]
    else:
        try:
            found = (resolver or resolve)(name, port)
            addresses = [a for a in (numeric(text) for text in found) if a is not None]
        except OSError as exc:
            raise Refused(f"The host {name[:64]!r} does not resolve: {exc}") from None
        if not addresses:
            raise Refused(f"The host {name[:64]!r} resolves to no address.")
    if name in allow.hosts:
        return addresses[0]
    for a in addresses:
        if not (is_public(a) or allow.admits(a)):
            # The address is not named: it would tell a tenant how an internal name resolves.
            raise Refused(f"The host {name[:64]!r} is not at a public address (it resolves to one that is not "
                          "public); an operator may allow it with BATCH_WEBHOOK_ALLOW.")
    return addresses[0]


async def pinned(url: httpx.URL, allow: Allow) -> tuple[httpx.URL, dict[str, Any]]:
    """`url` with its host replaced by the one address it was checked at (`check`: public or allowed), so a second
    resolution cannot point elsewhere (DNS rebinding); TLS still names, and verifies, the host (the extensions)."""
    port = url.port or (443 if url.scheme == "https" else 80)
    address = await asyncio.to_thread(check, url.host, port, allow)
    return url.copy_with(host=str(address)), {"sni_hostname": url.host} if url.scheme == "https" else {}
