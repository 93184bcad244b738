"""``python -m cli``: the ``deepinfer`` command."""
import sys

from cli.main import main

sys.exit(main())
