"""``python -m reactor.cli``: the ``reactor`` command."""

from . import entry

entry()
