import sys

from acl_fairseq.cli.prepare.cli import console_main as main

sys.exit(main())
