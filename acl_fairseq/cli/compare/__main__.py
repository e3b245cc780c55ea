import sys

from acl_fairseq.cli.compare.cli import main

sys.exit(main())
