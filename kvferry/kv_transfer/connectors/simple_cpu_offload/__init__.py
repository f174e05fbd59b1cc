"""SimpleCPUOffloadConnector's parts: a scheduler preset (``scheduler.py``), its step plan
(``metadata.py``) and options (``options.py``); the worker half is the OffloadingConnector's
(same jobs, same transfer engine)."""
