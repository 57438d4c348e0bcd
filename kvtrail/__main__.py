import sys

from kvtrail.cli import main

sys.exit(main())
