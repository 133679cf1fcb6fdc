"""``python -m torchdelegate.cli``: the ``torchdelegate`` command."""

from torchdelegate.cli.main import entry_point

entry_point()
