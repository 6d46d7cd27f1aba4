import sys

from services.cpu_attn.main import main

sys.exit(main())
