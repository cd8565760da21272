import sys

from ftjax.cli.main import main

sys.exit(main())
