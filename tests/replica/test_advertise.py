"""The URL a replica advertises in Redis when ``--advertise-url`` is not given
(replica/cli.py): a wildcard bind is no address a gateway can call, so the replica
advertises its own address on the route to Redis."""

from __future__ import annotations

import socket

from replica.cli import default_advertise_url


def _own_non_loopback_address() -> str | None:
    """An address of this host other than the loopback, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: a route lookup, nothing sent
            address = str(probe.getsockname()[0])
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_a_wildcard_bind_advertises_the_address_on_the_route_to_redis() -> None:
    assert default_advertise_url("0.0.0.0", 8101, "redis://127.0.0.1:6379/0") == (
        "http://127.0.0.1:8101"
    )
    assert default_advertise_url("::", 8101, None) == "http://127.0.0.1:8101"
    assert default_advertise_url("0.0.0.0", 8101, "redis://[::1]:6379") == "http://[::1]:8101"
    # An unresolvable Redis host: the best guess left, never the wildcard.
    assert default_advertise_url("0.0.0.0", 8101, "redis://no-such-host.invalid:6379") == (
        "http://127.0.0.1:8101"
    )
    own = _own_non_loopback_address()
    if own is not None:  # Redis on this host's own network address: that address
        assert default_advertise_url("0.0.0.0", 8101, f"redis://{own}:6379") == (
            f"http://{own}:8101"
        )


def test_a_bound_address_is_advertised_as_given_and_ipv6_is_bracketed() -> None:
    assert default_advertise_url("10.1.2.3", 8101, "redis://127.0.0.1:6379") == (
        "http://10.1.2.3:8101"
    )
    assert default_advertise_url("::1", 8101, None) == "http://[::1]:8101"
    assert default_advertise_url("replica-0.svc", 8101, None) == "http://replica-0.svc:8101"
