import pytest
from fork_server import serve_tools


@pytest.fixture(autouse=True)
def _served_tool_commands(monkeypatch):
    """The study's fairseq-train / fairseq-validate commands forked from one process that has
    imported fairseq (tests/fork_server.py)."""
    serve_tools(monkeypatch)
