"""Cluster mode's control plane: the card registry in etcd that every gateway of a cluster follows.

``registry`` (the records and views in etcd), ``follower`` (a gateway's card set kept on the view),
``liveness`` (cards held out when their agents stop reporting), ``agent`` (a host's agent: its cards'
health, publishing views when it leads), ``member`` (an etcd member an agent runs).  The command
line that drives it is ``kvgate.cli.cluster``; the card server an agent may run is
``kvgate.cards.network.server``, handed to it by ``kvgate.cli.agent``.
"""
