"""``python -m studies``: the converged study of docs/results.md.

python -m studies data ...       the study's data (``studies.data``)
python -m studies report ...     its tables and figures (``studies.report``)
python -m studies PHASE ...      its phases, e.g. movie-lr (``studies.phases``)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "data":
        from studies.data import main as data_main

        return data_main(args[1:])
    if args and args[0] == "report":
        from studies.report import main as report_main

        return report_main(args[1:])
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
    from studies.phases import main as phases_main

    return phases_main(args)


if __name__ == "__main__":
    sys.exit(main())
