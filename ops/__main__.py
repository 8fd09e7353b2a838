"""``python -m headscope``: the collect, train and eval commands (``headscope.commands``)."""
import sys

from .commands import main

sys.exit(main())
