"""The network card: directory cards of another host, served over TCP (``kvgate://`` / ``kvgates://``).

Both ends live here: ``card`` is the gateway's ``Card`` (cards/base.py's contract) with its ``conn``ections;
``server`` and ``serverconn`` are the card server (``kvgate export``, ``kvgate cluster serve --export``)
that serves a host's directory cards; ``wire`` is the frames they speak.
"""

from kvgate.cards.network.card import NetworkCard, is_network

__all__ = ["NetworkCard", "is_network"]
