"""The pieces of ``benchmarks/throughput.py``: its rows (``rows``), one backend run in a
child process (``backends``), a row's measurement (``measure``) and the report (``report``).
The child process itself is ``benchmarks/worker.py``."""
