import sys

from rapidspec.cli import main

sys.exit(main())
