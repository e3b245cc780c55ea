"""``acl-fairseq-study``: the converged study of docs/results.md.

acl-fairseq-study data ...       the study's data (``acl_fairseq.cli.study.data``)
acl-fairseq-study report ...     its tables and figures (``acl_fairseq.cli.study.report``)
acl-fairseq-study PHASE ...      its phases, e.g. movie-lr (``acl_fairseq.cli.study.phases``)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "data":
        from acl_fairseq.cli.study.data import main as data_main

        return data_main(args[1:])
    if args and args[0] == "report":
        from acl_fairseq.cli.study.report import main as report_main

        return report_main(args[1:])
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
    from acl_fairseq.cli.study.phases import main as phases_main

    return phases_main(args)


if __name__ == "__main__":
    sys.exit(main())
