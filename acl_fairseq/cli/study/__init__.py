"""``acl-fairseq-study``: the converged study (its data, phases and report)."""
