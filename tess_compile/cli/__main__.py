"""`python3 -m tess_compile.cli`: the `tess-compile` command."""

import sys

from tess_compile.cli import main

sys.exit(main())
