"""The chaos suite: hostile and broken input against real ``kvferry serve`` / ``kvferry proxy``
processes on loopback, measured (see ``harness.py`` and ``docs/reliability.md``)."""
