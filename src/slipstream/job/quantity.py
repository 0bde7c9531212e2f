"""Kubernetes resource quantities ("500m", "16Gi", "1.5", "2e3"), parsed exactly.

The grammar is the one the API server accepts (and the CRDs spell out as a
regular expression): a signed decimal number followed by a binary suffix
(Ki..Ei), a decimal suffix (n, u, m, k, M, G, T, P, E) or a decimal exponent.

Example::

    parse_quantity("16Gi")   # Decimal('17179869184')
    parse_quantity("500m")   # Decimal('0.5')
    parse_quantity("1.5.2")  # ValueError
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Same pattern as k8s.io/apimachinery resource.Quantity (as written in CRDs).
QUANTITY_RE = re.compile(
    r"^(?P<num>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))?$"
)

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}


def parse_quantity(value: object) -> Decimal:
    """The value of a quantity as an exact Decimal; ValueError if it is not one.

    Ints and floats are accepted as YAML gives them (``cpu: 4``); bools are not.
    """
    if isinstance(value, bool) or value is None:
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"not a quantity: {value!r}")
        return Decimal(repr(value))
    if not isinstance(value, str):
        raise ValueError(f"not a quantity: {value!r}")
    m = QUANTITY_RE.match(value)
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    try:
        number = Decimal(m.group("num"))
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"not a quantity: {value!r}") from None
    suffix = m.group("suffix") or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    return number * (Decimal(10) ** Decimal(suffix[1:]))


def quantity_text(value: object) -> str:
    """The string form used in manifests: ``4 -> "4"``, ``0.5 -> "0.5"``, ``"16Gi"`` unchanged."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


__all__ = ["parse_quantity", "quantity_text", "QUANTITY_RE"]
