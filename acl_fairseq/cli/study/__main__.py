import sys

from acl_fairseq.cli.study.cli import main

sys.exit(main())
