"""``python -m zfunc.io consolidate CKPT_DIR OUT`` (the same commands as ``zfunc``)."""

import sys

from zfunc.cli import main

sys.exit(main(sys.argv[1:], prog="python -m zfunc.io"))
