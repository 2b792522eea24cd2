import sys

from fasttnt.cli import main

sys.exit(main())
