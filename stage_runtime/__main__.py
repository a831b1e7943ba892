import sys

from stage_runtime.cli import main

if __name__ == "__main__":        # spawned worker ranks import this module as __mp_main__
    sys.exit(main())
