import sys

from nanoengine.cli import main

sys.exit(main())
