"""The network policy: which hosts an inferlet's outgoing HTTP may reach.

Default deny. The operator lists what is allowed (`[network] allow`) and what is refused even
then (`deny`). An entry is an IP address, a CIDR block (`10.0.0.0/8`, `::1/128`), a host name
(`api.example.com`) or every name under a domain (`*.example.com`). Names are matched before
anything is looked up; addresses are matched after, on every address the name resolves to, so
a name can never lead somewhere the policy refuses:

- a connection goes to an address that an `allow` entry names (by address or block), or that
  came from resolving an allowed name;
- an address in one of the `RESERVED` blocks (this host, private networks, link-local,
  multicast, reserved) is reached only when an `allow` address or block inside that reserved
  block contains it (neither a wider block nor a `*.domain` opens it), and only from a literal
  address or a name the policy allows by name;
- so a name is looked up only when an `allow` entry could admit it: one naming it, or an
  address or block reaching beyond the reserved blocks; a made-up name under a policy that
  allows only names and private addresses never reaches a DNS server;
- no address in a `deny` block is ever connected to, whatever allowed it;
- every check holds for each address a connection may really reach (`reachable`): the IPv4
  address inside an IPv6 form, and loopback for an unspecified address.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from typing import Literal

from attrs import frozen

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Origin = Literal["literal", "allowed-name", "other-name"]

RESERVED: tuple[Network, ...] = tuple(
    ipaddress.ip_network(block)
    for block in (
        "0.0.0.0/8",  # "this network": 0.0.0.0 reaches the host itself
        "10.0.0.0/8",
        "100.64.0.0/10",  # carrier-grade NAT
        "127.0.0.0/8",
        "169.254.0.0/16",  # link-local, cloud metadata services
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, with the broadcast address
        "::/128",
        "::1/128",
        "64:ff9b:1::/48",  # local-use NAT64
        "100::/64",
        "2001:db8::/32",
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local
        "ff00::/8",  # multicast
    )
)
"""Blocks refused unless an `allow` entry inside them names the address."""

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")
_UNSPECIFIED_V6 = ipaddress.IPv6Address("::")
_LOOPBACK_V4 = ipaddress.IPv4Address("127.0.0.1")
_LOOPBACK_V6 = ipaddress.IPv6Address("::1")
_IPV4_SHORTHAND = re.compile(r"[0-9a-fA-FxX.]+")


class PolicyError(ValueError):
    """An entry of the policy that is neither an address, a block nor a host name."""


@frozen
class NetworkPolicy:
    allow_networks: tuple[Network, ...] = ()
    allow_names: tuple[str, ...] = ()
    """Exact host names, lower case."""
    allow_domains: tuple[str, ...] = ()
    """Suffixes from `*.domain` entries, with their leading dot."""
    deny_networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, allow: Iterable[str], deny: Iterable[str] = ()) -> NetworkPolicy:
        networks: list[Network] = []
        names: list[str] = []
        domains: list[str] = []
        for entry in allow:
            network = _network(entry)
            if network is not None:
                networks.append(network)
            elif entry.startswith("*."):
                domains.append("." + _name(entry[2:]))
            else:
                names.append(_name(entry))
        denied = []
        for entry in deny:
            network = _network(entry)
            if network is None:
                raise PolicyError(f"network.deny takes addresses and blocks, not {entry!r}")
            denied.append(network)
        return cls(tuple(networks), tuple(names), tuple(domains), tuple(denied))

    def allows_name(self, host: str) -> bool:
        """Whether `host` (a name, not an address) is allowed by name."""
        host = host.lower().rstrip(".")
        return host in self.allow_names or any(host.endswith(d) for d in self.allow_domains)

    def may_resolve(self, host: str) -> bool:
        """Whether looking `host` up could lead anywhere allowed; when not, it is refused
        without a lookup, so a made-up name never reaches a DNS server."""
        return self.allows_name(host) or any(
            not _reserved(network) for network in self.allow_networks
        )

    def allows_address(self, address: Address, *, origin: Origin) -> bool:
        """Whether a connection may go to `address`, given as is (`literal`) or found by
        resolving a name that the policy allows by name (`allowed-name`) or does not
        (`other-name`)."""
        return all(self._allows(each, origin) for each in reachable(address))

    def _allows(self, address: Address, origin: Origin) -> bool:
        if _inside(address, self.deny_networks):
            return False
        reserved = [b for b in RESERVED if b.version == address.version and address in b]
        if reserved:
            return origin != "other-name" and all(self._opens(b, address) for b in reserved)
        return origin == "allowed-name" or _inside(address, self.allow_networks)

    def _opens(self, block: Network, address: Address) -> bool:
        return any(address in n and _subnet(n, block) for n in self.allow_networks)


def reachable(address: Address) -> tuple[Address, ...]:
    """Every address a connection to `address` may reach: an IPv4-mapped address is its IPv4
    address; other IPv6 forms that carry one (IPv4-compatible, NAT64, 6to4, Teredo) reach both;
    an unspecified address (`0.0.0.0/8`, `::`) reaches this host, so it also counts as
    loopback."""
    if isinstance(address, ipaddress.IPv6Address):
        address = ipaddress.IPv6Address(int(address))  # without a scope id
        if address.ipv4_mapped is not None:
            address = address.ipv4_mapped
    found: list[Address] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            found.append(embedded)
    for each in list(found):
        if each in _THIS_NETWORK or each == _UNSPECIFIED_V6:
            found.append(_LOOPBACK_V4 if each.version == 4 else _LOOPBACK_V6)
    return tuple(found)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    value = int(address)
    if address in _NAT64 or 1 < value < 1 << 32:
        return ipaddress.IPv4Address(value & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    return None


def _reserved(network: Network) -> bool:
    return any(_subnet(network, block) for block in RESERVED)


def _subnet(network: Network, block: Network) -> bool:
    if isinstance(network, ipaddress.IPv4Network) and isinstance(block, ipaddress.IPv4Network):
        return network.subnet_of(block)
    if isinstance(network, ipaddress.IPv6Network) and isinstance(block, ipaddress.IPv6Network):
        return network.subnet_of(block)
    return False


def _inside(address: Address, networks: Iterable[Network]) -> bool:
    return any(address in n for n in networks if n.version == address.version)


def _network(entry: str) -> Network | None:
    try:
        return ipaddress.ip_network(entry.strip("[]"), strict=False)
    except ValueError:
        return None


def _name(entry: str) -> str:
    name = entry.lower().rstrip(".")
    labels = name.split(".")
    if not name or any(
        not label or len(label) > 63 or not all(c.isalnum() or c == "-" for c in label)
        for label in labels
    ):
        raise PolicyError(f"{entry!r} is not an address, a block or a host name")
    return name


def parse_address(host: str) -> Address | None:
    """`host` as an IP address (brackets allowed; also the short, decimal, octal and hex IPv4
    forms a resolver would accept, like `127.1` or `0x7f000001`), or None for a name."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if _IPV4_SHORTHAND.fullmatch(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            pass
    return None
