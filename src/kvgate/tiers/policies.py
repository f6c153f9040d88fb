"""The RAM tier's eviction policies by their config name (``eviction_policy``).

A card runs the same rules in its index's columns (``kvgate.tiers.sampled``,
the same names as its ``kind``).
"""

from __future__ import annotations

from typing import Final

from kvgate.tiers.adaptive import AdaptivePolicy
from kvgate.tiers.eviction import EvictionPolicy, LruPolicy, PrefixPolicy

POLICIES: Final[dict[str, type[EvictionPolicy]]] = {"adaptive": AdaptivePolicy, "prefix": PrefixPolicy,
                                                    "lru": LruPolicy}
DEFAULT_POLICY: Final = "adaptive"


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by its config name (``eviction_policy``)."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}") from None
