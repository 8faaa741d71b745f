"""`python -m pdserve`: the `pdserve` command."""
import sys

from pdserve.cli import main

sys.exit(main())
