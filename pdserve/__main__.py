"""`python -m pdserve`: the `pdserve` command."""
import sys

from pdserve.deploy.cli import main

sys.exit(main())
