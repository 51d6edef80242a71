"""How every gorgo process spells a boolean environment value: the control plane and the gateway alike.

An operator who writes ``DEBUG=yes`` for the control plane and ``GORGO_AUTH=yes`` for a gateway
means the same thing, so both read it with this one function. Django-free (``routing`` imports
none), and one of the few gateway modules the control plane may import (tests/test_layers.py).
"""

from __future__ import annotations

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def parse_bool(raw: str) -> bool:
    """``raw`` as a boolean (any case, surrounding spaces ignored); ``ValueError`` names the words.

    Callers decide what unset or empty means (their default) before asking.
    """
    value = raw.strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ValueError(f"{raw!r} is not a boolean (use true/false, yes/no, on/off or 1/0)")
