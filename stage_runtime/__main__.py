import sys

from stage_runtime.cli import main

sys.exit(main())
