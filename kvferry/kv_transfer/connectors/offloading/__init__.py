"""OffloadingConnector halves: ``scheduler.py`` (planning), ``worker.py`` (moving bytes),
``metadata.py`` (what passes between them) and ``layout.py`` (sizes and folders)."""
