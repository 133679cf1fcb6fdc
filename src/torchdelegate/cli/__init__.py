"""The ``torchdelegate`` command: lower, inspect, run, prepare, demo.

Exit codes: 0 success; 1 the work failed (a bad file, a backend error, outputs that differ
from eager in the demo); 2 the command line was wrong. Errors go to stderr as one line,
``torchdelegate: error: ...``; ``--verbose`` adds the traceback. One module per command, which
defines its flags and runs it; ``command.py`` holds what they share, ``main.py`` puts them together.
"""

from torchdelegate.cli.command import CommandError, UsageError, printable
from torchdelegate.cli.main import entry_point, main

__all__ = ["CommandError", "UsageError", "entry_point", "main", "printable"]
