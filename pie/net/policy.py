"""The network policy: which hosts an inferlet's outgoing HTTP may reach.

Default deny. The operator lists what is allowed (`[network] allow`) and what is refused even
then (`deny`). An entry is an IP address, a CIDR block (`10.0.0.0/8`, `::1/128`), a host name
(`api.example.com`) or every name under a domain (`*.example.com`). Names are matched before
anything is looked up; addresses are matched after, on every address the name resolves to, so
a name can never lead somewhere the policy refuses:

- a connection goes to an address that an `allow` entry names (by address or block), or that
  came from resolving an allowed name;
- no address in a `deny` block is ever connected to, whatever allowed it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from attrs import frozen

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


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

    def allows_address(self, address: Address, *, by_name: bool) -> bool:
        """Whether a connection may go to `address`, found by resolving an allowed name
        (`by_name`) or given as is."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if any(address in n for n in self.deny_networks if n.version == address.version):
            return False
        return by_name or any(
            address in n for n in self.allow_networks if n.version == address.version
        )


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
    """`host` as an IP address (brackets allowed), or None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
