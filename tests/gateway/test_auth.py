from __future__ import annotations

from gateway.auth import Authenticator, Tenant


def test_conversations_are_scoped_by_tenant_in_keyed_mode() -> None:
    alpha, beta = Tenant("alpha", "sa"), Tenant("beta", "sb")
    keyed = Authenticator({"sk-a": alpha, "sk-b": beta})
    a = keyed.scoped_conversation(alpha, "session-1")
    b = keyed.scoped_conversation(beta, "session-1")
    assert a is not None and b is not None and a != b
    assert keyed.scoped_conversation(alpha, "session-1") == a  # stable: every gateway agrees
    assert keyed.scoped_conversation(alpha, None) is None
    # A tenant cannot forge another's scope through the id it sends.
    assert keyed.scoped_conversation(Tenant("alph", "x"), "a\x00session-1") != a


def test_open_mode_keeps_the_client_conversation_key() -> None:
    open_auth = Authenticator()
    tenant = open_auth.authenticate(None)
    assert open_auth.scoped_conversation(tenant, "session-1") == "session-1"
