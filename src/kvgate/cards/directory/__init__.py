"""The directory card: objects as files under a directory on a local disk or a shared filesystem.

``card`` is the ``Card`` (cards/base.py's contract); the rest are its parts: ``layout`` (where an object's
file is), ``write`` (writing one whole or not at all), ``scan`` (what a card holds, at open), ``directio``
(O_DIRECT reads), ``claim`` (one gateway per card), ``label`` (the card's serial), ``snapshot`` (its index
kept across restarts), ``errors`` (what an OSError of the medium means).
"""

from kvgate.cards.directory.card import DirectoryCard

__all__ = ["DirectoryCard"]
