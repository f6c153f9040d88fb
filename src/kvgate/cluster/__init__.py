"""Cluster mode: the card registry in etcd that every gateway of a cluster follows."""
