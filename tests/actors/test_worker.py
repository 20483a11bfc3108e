"""Where a worker's gloo binds: the interface of its Ray node's address, so that ranks on other
nodes reach it there (a hostname that resolves to loopback would send them to their own)."""

from __future__ import annotations

import os

import psutil
import pytest

from rlhf_paro.actors.worker import bind_gloo, interface_of


def _some_ipv4_interface() -> tuple[str, str]:
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family.name == "AF_INET":
                return name, a.address
    pytest.skip("no interface with an IPv4 address")


def test_interface_of_an_address_is_the_one_that_holds_it_and_none_for_a_foreign_one():
    name, address = _some_ipv4_interface()
    assert interface_of(address) == name
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: never a local address here


def test_gloo_binds_to_the_interface_of_the_node_address(monkeypatch):
    name, address = _some_ipv4_interface()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    bind_gloo(address)
    assert os.environ["GLOO_SOCKET_IFNAME"] == name


def test_gloo_keeps_the_interface_a_user_named_and_defaults_for_an_unknown_address(monkeypatch):
    _, address = _some_ipv4_interface()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    bind_gloo(address)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    bind_gloo("203.0.113.77")  # gloo's own default stays (the hostname's address)
    assert "GLOO_SOCKET_IFNAME" not in os.environ
