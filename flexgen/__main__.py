"""`python -m flexgen ...` is the `flexgen` command."""
import sys

from .cli import main

sys.exit(main())
