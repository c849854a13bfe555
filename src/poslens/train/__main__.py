"""``python -m poslens.train train|tokenize`` (also the torchrun entry: ``torchrun ... -m poslens.train train``)."""

import sys

from poslens.train.command import main

sys.exit(main())
