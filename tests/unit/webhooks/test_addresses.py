"""webhooks/addresses.py: which hosts a webhook may reach (issue 31, finding 9: SSRF)."""

from __future__ import annotations

import ipaddress

import pytest
from django.core.exceptions import ImproperlyConfigured

from webhooks.addresses import (
    AddressRefused,
    address_refusal,
    allowed_networks_check,
    target_resolve,
    url_check,
)

REFUSED_ADDRESSES = [
    "127.0.0.1",
    "127.5.6.7",
    "10.1.2.3",
    "172.16.0.1",
    "192.168.1.1",
    "169.254.169.254",  # the cloud metadata service
    "100.64.0.1",  # shared address space (CGNAT)
    "0.0.0.0",
    "224.0.0.1",
    "239.255.255.250",
    "240.0.0.1",
    "255.255.255.255",
    "198.18.0.1",
    "::1",
    "::",
    "fe80::1",
    "fc00::1",
    "fd12:3456::1",
    "fec0::1",
    "ff02::1",
    "::ffff:127.0.0.1",  # IPv4-mapped loopback
    "::ffff:169.254.169.254",
    "2002:7f00:1::1",  # 6to4 around 127.0.0.1
    "2002:a9fe:a9fe::1",  # 6to4 around 169.254.169.254
    "64:ff9b::a9fe:a9fe",  # NAT64 around 169.254.169.254
    "2001:db8::1",
]


@pytest.mark.parametrize("address", REFUSED_ADDRESSES)
def test_loopback_private_link_local_multicast_reserved_and_wrapped_addresses_are_refused(address):
    # given no allow-list, then the address is refused, saying why
    refusal = address_refusal(ipaddress.ip_address(address), ())
    assert refusal and "IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS" in refusal


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111"])
def test_public_addresses_are_allowed(address):
    assert address_refusal(ipaddress.ip_address(address), ()) is None


def test_an_allow_listed_network_is_allowed_and_nothing_beside_it():
    allowed = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("10.20.0.0/16"))
    assert address_refusal(ipaddress.ip_address("127.0.0.1"), allowed) is None
    assert address_refusal(ipaddress.ip_address("::ffff:127.0.0.1"), allowed) is None  # mapped: the same
    assert address_refusal(ipaddress.ip_address("10.20.3.4"), allowed) is None
    assert address_refusal(ipaddress.ip_address("10.21.0.1"), allowed)
    assert address_refusal(ipaddress.ip_address("169.254.169.254"), allowed)
    assert address_refusal(ipaddress.ip_address("::1"), allowed)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:6379/",
        "http://localhost/hook",
        "http://LOCALHOST./hook",
        "http://app.localhost/hook",
        "http://[::1]/hook",
        "http://0.0.0.0/hook",
        "http://169.254.169.254/latest/meta-data/",
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://[::ffff:7f00:1]/hook",
        "http://2130706433/hook",  # 127.0.0.1 as one number: resolves numerically
        "http://0x7f.1/hook",
        "http://127.1/hook",
        "https://192.168.0.10/hook",
    ],
)
def test_a_url_whose_host_is_or_resolves_to_a_refused_address_is_refused_at_save_and_at_delivery(
    url, settings
):
    settings.IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS = []
    with pytest.raises(AddressRefused):
        url_check(url)
    with pytest.raises(AddressRefused):
        target_resolve(url)


def test_the_allow_list_setting_lets_internal_receivers_in(settings):
    settings.IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    url_check("http://127.0.0.1:8000/hook")
    target = target_resolve("http://127.0.0.1:8000/hook?x=1")
    assert (target.address, target.port, target.path) == ("127.0.0.1", 8000, "/hook?x=1")
    # a name is refused whatever it resolves to
    with pytest.raises(AddressRefused):
        url_check("http://localhost:8000/hook")


def test_a_malformed_allow_list_fails_closed(settings):
    settings.IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.0/8", "not-a-network"]
    with pytest.raises(ImproperlyConfigured, match="not-a-network"):
        url_check("http://127.0.0.1/hook")


def test_a_malformed_allow_list_is_a_system_check_error(settings):
    settings.IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS = ["10.0.0.0/33"]
    (error,) = allowed_networks_check()
    assert error.id == "webhooks.E001" and "10.0.0.0/33" in error.msg
    settings.IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS = ["10.0.0.0/8"]
    assert allowed_networks_check() == []
