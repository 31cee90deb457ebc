"""`python -m kvserve`: the `kvserve` command."""
import sys

from kvserve.cli import main

sys.exit(main())
