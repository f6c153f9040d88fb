"""`kvgate bench`: the gateway measured against this machine's physical limits.

A figure in GiB/s says little on its own: the same gateway is "fast" on one
box and "slow" on another, and a shared machine makes any absolute number
noisy.  So every figure is measured in the same run, on the same bytes and
destinations, next to the thing that bounds it physically (``np.copyto`` for
the RAM tier, raw ``preadv``/``pwritev`` of the same files for the cards), and
what is reported is the ratio.  Both sides run in alternating rounds, so a
burst of load elsewhere hits both alike, and the best round of each is kept:
noise only ever slows a pass down, it never speeds one up.

The modules, by job (each imports only those above it in this list):

    processes  ``kvgate serve`` and ``kvgate cluster serve`` children: for the bench, ``benchmarks/`` and
               ``demo/`` (the tests build on them)
    baselines  the physical limits: raw reads and writes of the same files, a loopback socket, the page cache
    measure    alternating rounds, their series, and a figure as the ratio to its baseline
    trace      a request trace, its block payloads, and the eviction policies replayed in process
    harness    ``Bench``: the gateways, clients and region of figures 1-5
    restores   ``CardsBench``: long restores from N cards under each placement (``--cards``)
    objects    ``ObjectsBench``: a card of N objects started cold, its index's cost (``--objects``)
    replay     ``TraceBench``: a trace replayed against real gateways (``--trace``)
    report     tables, notes and the plot
    command    the flags, and ``run_bench``, which ``kvgate bench`` calls

Nothing is imported here, so a script that only starts processes (under an
engine's venv, say) imports ``kvgate.bench.processes`` and not the bench.
"""

from kvgate.errors import KvgateError


class BenchError(KvgateError, RuntimeError):
    """The bench cannot run or got a wrong answer; the message says which."""
