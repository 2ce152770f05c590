import sys

from tgi_hpc.cli import main

sys.exit(main())
