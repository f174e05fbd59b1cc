"""The offload connectors' protocol adapter, shared by OffloadingConnector and its
SimpleCPUOffloadConnector preset: ``facade.py`` (the split-connector base), ``scheduler.py``
(planning, with ``state.py`` and ``plans.py``), ``worker.py`` and ``job_runner.py`` (moving
bytes), ``metadata.py`` and ``worker_metadata.py`` (what passes between the halves),
``options.py`` and ``layout.py`` (options, sizes and folders)."""
