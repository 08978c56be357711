"""`python -m flashport info | check | bench`."""
import sys

from .cli import main

sys.exit(main())
