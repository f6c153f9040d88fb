"""The ``kvgate`` command: ``main`` parses the flags (``main.build_parser``) and runs a command.

The top layer: it puts together what the layers below keep apart, such as a cluster agent
(``kvgate.cluster``, control plane) serving cards over the network (``kvgate.cards.network.server``):
``agent``.
"""

from kvgate.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
