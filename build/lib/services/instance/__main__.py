import sys

from services.instance.main import main

sys.exit(main())
