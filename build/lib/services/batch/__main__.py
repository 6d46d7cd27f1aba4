import sys

from services.batch.main import main

sys.exit(main())
