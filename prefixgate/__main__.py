import sys

from prefixgate.cli import main

sys.exit(main())
