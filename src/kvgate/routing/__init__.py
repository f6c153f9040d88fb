"""kvgate router: block hashes as engines make them (``hashing``), an index of which source holds which
block fed by KV events (``index``, ``feeds``), scoring endpoints by what they can restore and how loaded
they are (``score``), and the HTTP front that proxies OpenAI requests by those scores.

Layer: may import kvgate's bottom layer, ``kvevents``, ``protocol`` and ``client`` (tests/test_layers.py).
"""
