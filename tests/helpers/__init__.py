"""Shared test helpers: scheduler drivers, scripted connectors and transfer simulators, test
connectors loaded by module path, and harnesses for engine and server processes."""
