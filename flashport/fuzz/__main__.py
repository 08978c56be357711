import sys

from .driver import cli

if __name__ == "__main__":   # not when a spawned worker imports this module as __mp_main__
    sys.exit(cli())
