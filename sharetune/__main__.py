import sys

from sharetune.cli import main

sys.exit(main())
