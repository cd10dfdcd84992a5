import sys

from omlx_core.cli import main

sys.exit(main())
