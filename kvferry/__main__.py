import sys

from kvferry.entrypoints.cli import main

sys.exit(main())
