"""kvferry's tests, one folder per package of ``kvferry/``; ``tests/e2e/`` runs the whole system.

A package so that shared helpers import as ``tests.helpers`` and subprocesses find the test
connectors by module path (``tests.helpers.pd_test_connector``) with the repository root on
``PYTHONPATH``.
"""
