"""egress: a tenant's webhook endpoint reaches public addresses only, in every form an address can be written,
unless the operator's allow-list opens it; the name is resolved once (injected here) and that address is used."""

from __future__ import annotations

import ipaddress

import pytest

from batch_dagster.features import egress
from batch_dagster.features.egress import Allow, Refused, check, is_public, numeric

NONE = Allow()

NOT_PUBLIC = [
    "127.0.0.1", "127.8.9.10", "10.0.0.1", "172.16.0.1", "192.168.1.1", "100.64.0.1",  # loopback, private, shared
    "169.254.169.254", "169.254.0.1",  # link-local: the cloud metadata service
    "0.0.0.0", "0.1.2.3", "255.255.255.255", "224.0.0.1", "239.1.2.3", "240.0.0.1", "192.0.2.1", "198.18.0.1",
    "::1", "::", "fc00::1", "fd12:3456::1", "fe80::1", "fe80::1%eth0", "ff02::1", "ff0e::1",
    "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1", "[::ffff:7f00:1]",  # IPv4-mapped
    "2002:7f00:1::", "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe",  # 6to4 and NAT64 of internal IPv4
    "2001:db8::1",  # documentation
    "2130706433", "0x7f000001", "0x7f.1", "0177.0.0.1", "127.1", "0", "017700000001",  # inet_aton forms
]
PUBLIC = ["93.184.216.34", "8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "[2606:4700:4700::1111]",
          "::ffff:8.8.8.8", "2002:808:808::", "64:ff9b::808:808"]


@pytest.mark.parametrize("host", NOT_PUBLIC)
def test_every_internal_address_form_is_refused(host):
    address = numeric(host)
    assert address is not None and not is_public(address)
    with pytest.raises(Refused, match="not at a public address"):
        check(host, 80, NONE, resolver=lambda h, p: pytest.fail("a numeric host is not resolved"))


@pytest.mark.parametrize("host", PUBLIC)
def test_public_addresses_pass(host):
    assert check(host, 443, NONE) == numeric(host)


def test_inet_aton_forms_read_as_a_resolver_reads_them():
    assert numeric("2130706433") == numeric("0x7f.1") == numeric("0177.0.0.1") == ipaddress.ip_address("127.0.0.1")
    assert numeric("example.com") is None and numeric("1.2.3.4.5") is None and numeric("localhost") is None


def test_a_name_is_checked_at_every_address_it_resolves_to():
    calls = []

    def resolver(host, port):
        calls.append((host, port))
        return {"hooks.example": ["93.184.216.34"], "mixed.example": ["93.184.216.34", "10.0.0.5"],
                "meta.example": ["169.254.169.254"], "v6.example": ["::1"], "none.example": []}[host]

    assert check("Hooks.Example.", 8443, NONE, resolver) == ipaddress.ip_address("93.184.216.34")
    assert calls == [("hooks.example", 8443)]  # once, lowercased, without the root dot
    for host in ("mixed.example", "meta.example", "v6.example"):
        with pytest.raises(Refused, match="not at a public address"):
            check(host, 80, NONE, resolver)
    with pytest.raises(Refused, match="no address"):
        check("none.example", 80, NONE, resolver)

    def fails(host, port):
        raise OSError("Name or service not known")

    with pytest.raises(Refused, match="does not resolve"):
        check("nowhere.example", 80, NONE, fails)


def test_the_allow_list_opens_hosts_and_networks_on_purpose():
    allow = Allow.parse(["127.0.0.1", " 10.1.0.0/16", "hooks.internal", "[fd00::/8]", ""])
    assert check("127.0.0.1", 80, allow) == ipaddress.ip_address("127.0.0.1")
    assert check("10.1.2.3", 80, allow) == ipaddress.ip_address("10.1.2.3")
    assert check("fd00::7", 80, allow) == ipaddress.ip_address("fd00::7")
    assert check("HOOKS.internal", 80, allow, lambda h, p: ["10.9.9.9"]) == ipaddress.ip_address("10.9.9.9")
    assert check("::ffff:127.0.0.1", 80, Allow.parse(["127.0.0.0/8"])) is not None  # judged as its IPv4 address
    for host in ("10.2.0.1", "127.0.0.2", "169.254.169.254", "::1"):
        with pytest.raises(Refused):
            check(host, 80, allow)
    with pytest.raises(ValueError, match="neither a host nor a CIDR"):
        Allow.parse(["10.0.0.0/33"])
    with pytest.raises(ValueError, match="neither a host nor a CIDR"):
        Allow.parse(["http://x"])


def test_the_default_resolver_is_looked_up_when_called(monkeypatch):
    monkeypatch.setattr(egress, "resolve", lambda host, port: ["10.0.0.1"])
    with pytest.raises(Refused):
        check("anything.example", 80, NONE)
