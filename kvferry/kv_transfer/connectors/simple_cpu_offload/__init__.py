"""SimpleCPUOffloadConnector halves: ``scheduler.py`` and ``metadata.py``; the worker half is
the OffloadingConnector's (same jobs, same transfer engine)."""
