"""Where the tools find fairseq's commands and the plugin (``--user-dir``)."""

import sys
from pathlib import Path

import acl_fairseq

# the plugin's own folder: fairseq's --user-dir, found from the installed package
USER_DIR = Path(acl_fairseq.__file__).resolve().parent
# fairseq-train, fairseq-validate, ... of the running interpreter's environment
BIN = Path(sys.executable).parent
