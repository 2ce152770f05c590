"""`python -m engine`: the TGI-compatible server launcher."""
import sys

from engine.launcher import main

sys.exit(main())
