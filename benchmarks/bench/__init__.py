"""The parts of benchmarks/run.py: the queues it measures, the processes that move messages, one run.

``backends``
    what is measured: a fresh schema per run (:class:`~bench.backends.Target`) and the push/pop/ack of
    each design through the engine's public API, the naive baseline's and PGMQ's statements.
``workers``
    the producer and consumer processes, and the bitmaps that check every message came once.
``measure``
    one run of one design at one point: start the workers, time the window, drain, check, collect.
``report``
    the text tables run.py prints.
"""
