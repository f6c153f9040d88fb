"""Where a directory card keeps what it keeps: the names of its files and directories.

One place for the layout, so the writers, the scan and the card agree on it::

    <location>/kvgate-card.json           label: serial, format, creation time
    <location>/kvgate-card.lock           claim: an advisory lock, and who took it last
    <location>/kvgate-index               the gateway's index snapshot (kvgate.tiers.restart)
    <location>/kvgate-heads               shared-head ids (kvgate.heads)
    <location>/db<NN>/<hh>/<digest hex>   one object per file (header + payload)

Objects are named by the digest of their full key, so the name is fixed-size
and safe whatever the key holds; the header inside still carries the full key,
and a reader checks it, so a digest collision or a misplaced file reads as
``ObjectCorrupt``, never as someone else's data.  ``NN`` shards the objects
over ``num_dbs`` directories and ``hh`` fans each one out 256 ways, which keeps
directories small enough for filesystems that slow down on huge ones.

A file being written carries ``TEMP_MARK`` and its writer's host, boot and
pid after its final name (``<name>.tmp.<host>-<boot>.<pid>.<thread>``): no
lookup ever opens it, and a scan can tell a dead writer's leftover from a
write in progress (``kvgate.cards.directory.scan``).
"""

from __future__ import annotations

import re

LABEL_NAME = "kvgate-card.json"
LOCK_NAME = "kvgate-card.lock"
HEADS_NAME = "kvgate-heads"  # shared-head ids, little-endian u64s, appended under flock
SNAPSHOT_NAME = "kvgate-index"

TEMP_MARK = ".tmp."
# <host>-<boot>.<pid>.<thread> after the mark (see the module doc)
TEMP_OWNER_RE = re.compile(r"([0-9a-f]{8})-([0-9a-f]{8})\.([0-9]+)\.[0-9]+")
DB_RE = re.compile(r"db[0-9]{2,}")
FANOUT_RE = re.compile(r"[0-9a-f]{2}")
OBJECT_RE = re.compile(r"[0-9a-f]{32}")


def db_dir_names(num_dbs: int) -> list[str]:
    """The names of the ``num_dbs`` shard directories, by index."""
    return [f"db{i:02d}" for i in range(num_dbs)]
