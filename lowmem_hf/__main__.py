"""``python -m lowmem_hf ...`` is ``lowmem-hf ...`` (also ``torchrun -m lowmem_hf run SCRIPT``)."""

import sys

from .cli import main

sys.exit(main())
