"""The ``kvgate`` command: ``main`` parses the flags (``main.build_parser``) and runs a command.

The top layer: it puts together what the layers below keep apart.

- ``main``: the parser and every command but ``kvgate cluster``;
- ``cluster`` / ``cluster_flags``: ``kvgate cluster``, the card registry from the command line (its
  flags apart, so building the parser needs no etcd3aio);
- ``agent``: ``kvgate cluster serve``, a cluster agent (``kvgate.cluster``, control plane) serving
  cards over the network (``kvgate.cards.network.server``).
"""

from kvgate.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
