"""What tests share that is not a fixture: servers and their ports, waits, clients, parsers.

A test imports these from here, never from another test module or a ``conftest.py``: a test
file is then free to move or go, and a bench script reuses the same helpers. Fixtures stay in
the ``conftest.py`` beside the tests that use them.
"""
