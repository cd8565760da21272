import sys

from ftjax.cli import main

sys.exit(main())
